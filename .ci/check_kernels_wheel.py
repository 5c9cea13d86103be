"""Run by `nox -s build` inside a fresh venv holding only torch and the moe-kernels-triton wheel:
the package imports, its declared dependencies are torch and Triton alone, Triton only where Triton
publishes wheels (triton on Linux, triton-windows on Windows; none on macOS), and one op runs."""

from importlib.metadata import requires

import torch

import moe_kernels


def _split(req: str) -> tuple[str, str]:
    """(name, marker) of a Requires-Dist line, the marker with quotes and spaces normalised."""
    spec, _, marker = req.partition(";")
    name = spec.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
    return name, " ".join(marker.replace("'", '"').split())


deps = dict(_split(r) for r in requires("moe-kernels-triton") or [] if "extra ==" not in r)
expected = {
    "torch": "",
    "triton": 'sys_platform == "linux"',
    "triton-windows": 'sys_platform == "win32"',
}
assert deps == expected, deps
print("moe_kernels", moe_kernels.__version__, "requires", deps)

from moe_kernels import route  # noqa: E402

plan = route(torch.randn(6, 4).softmax(-1), 2)
assert int(plan.counts.sum()) == 12
print("route ok on", plan.counts.device)
