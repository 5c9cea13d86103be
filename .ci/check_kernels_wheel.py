"""Run by `nox -s build` inside a fresh venv holding only torch and the moe-kernels wheel: the
package imports, its declared dependencies are torch and triton alone, and one op runs."""

from importlib.metadata import requires

import torch

import moe_kernels

deps = sorted(
    {
        r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        for r in requires("moe-kernels") or []
        if "extra ==" not in r
    }
)
assert deps == ["torch", "triton", "triton-windows"], deps
print("moe_kernels", moe_kernels.__version__, "requires", deps)

from moe_kernels import route  # noqa: E402

plan = route(torch.randn(6, 4).softmax(-1), 2)
assert int(plan.counts.sum()) == 12
print("route ok on", plan.counts.device)
