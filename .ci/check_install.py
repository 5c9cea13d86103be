"""Run by ``nox -s build`` inside a fresh venv where moe-model's and moe-tools' wheels were
installed from ``dist/`` with stand-ins of PyPI's unrelated ``moe-kernels`` offered beside them:
``moe_kernels`` comes from our ``moe-kernels-triton``, the other project is not installed, our
packages declare ``moe-kernels-triton``, and a layer and ``moe-bench`` run."""

from importlib.metadata import PackageNotFoundError, distribution, packages_distributions, requires

import torch

assert packages_distributions()["moe_kernels"] == ["moe-kernels-triton"], packages_distributions()
try:
    distribution("moe-kernels")
except PackageNotFoundError:
    pass
else:
    raise AssertionError("the unrelated moe-kernels got installed")
for dist in ("moe-model", "moe-tools"):
    specs = [r.split(";")[0] for r in requires(dist) or []]
    names = {s.split(">")[0].split("<")[0].split("=")[0].strip() for s in specs}
    assert "moe-kernels-triton" in names and "moe-kernels" not in names, (dist, names)
print("moe_kernels from moe-kernels-triton", distribution("moe-kernels-triton").version)

from moe_model import MoELayer  # noqa: E402
from moe_tools.cli import main  # noqa: E402

layer = MoELayer(32, n_experts=4, top_k=2, hidden=16, impl="triton_fp32")
assert layer(torch.randn(8, 32)).shape == (8, 32)
assert main(["verify", "--device", "cpu", "--ops", "route,dispatch", "--shapes", "1"]) == 0
print("MoELayer and moe-bench verify ok")
