"""What one registry entry is, and the comparisons its checks use.

An :class:`OpSpec` describes one public op of ``moe_kernels``: how to build its inputs for a size
class, its reference twin, an independent naive oracle, the torch-native version it replaces,
optional peers (FBGEMM, torchao) and the bytes one call must move. ``moe-bench verify`` and
``moe-bench kernels`` (and the pytest-benchmark suite) iterate the registry; nothing else lists
the ops.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_kernels.testing import ULP, bound_violations, execution_path

Sizes = Mapping[str, Any]  # one problem's sizes and options, e.g. {"T": 4096, "E": 16, "k": 8}
Thunk = Callable[[], object]
SIZE_CLASSES = ("quick", "full")  # the benchmark shapes: small (CPU, --quick) and full (CUDA)


class CheckFailed(AssertionError):
    """A comparison did not hold; the message says which and by how much."""


@dataclass
class Problem:
    """One call's inputs: the op is called as ``op(*args, **kwargs)``. ``aux`` holds what the
    oracle and the peers need beyond the arguments (e.g. the routing scores of a plan)."""

    label: str
    sizes: Sizes
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OpSpec:
    """One public op of ``moe_kernels`` (``name`` is its name in ``moe_kernels.__all__``).

    * ``sizes``: per size class (``SIZE_CLASSES``) the benchmark problems' sizes;
      ``draw(rng, large)``: the sizes of one random verify problem (``large`` on CUDA).
    * ``make(sizes, gen, device)``: the :class:`Problem` (random values drawn with ``gen``).
    * ``reference``: the ``moe_kernels.reference`` twin, called like the op.
    * ``oracle(problem, outputs)``: an independent naive computation (loops, float64) checked
      against the op's outputs; raises :class:`CheckFailed`, returns the largest error it saw.
    * ``bytes_moved(problem)``: the minimum bytes one call reads + writes; ``flops`` for GEMMs.
    * ``native(problem)``: a thunk of the torch-native version the op replaces (None: none).
    * ``fbgemm(ops, problem)``: a thunk of FBGEMM's op, given ``torch.ops.fbgemm`` (used when
      ``fbgemm_gpu.experimental.gen_ai.moe`` imports); ``torchao(problem)``: torchao's kernel.
    * ``mutates``: argument positions the op writes in place (their values are outputs too);
      ``specified(outputs)``: the part of the outputs the contract defines (default all).
    * ``reference_tol``: (rtol, atol relative to the largest value) of the kernel against its
      reference where they are not bitwise equal by contract (summation order, exp).
    * ``bound(problem)``: (float64 value, bound of the kernel's roundings) of output 0, for ops
      whose result rounds inside (a chain of GEMMs); the oracle checks against it, and in the
      interpreter the reference comparison too (``moe_kernels.testing.reference_bound``).
    """

    name: str
    sizes: Mapping[str, Sequence[Sizes]]
    draw: Callable[[random.Random, bool], Sizes]
    make: Callable[[Sizes, torch.Generator, torch.device], Problem]
    reference: Callable[..., Any]
    oracle: Callable[[Problem, tuple[torch.Tensor, ...]], float]
    bytes_moved: Callable[[Problem], int]
    native: Callable[[Problem], Thunk] | None = None
    fbgemm: Callable[[Any, Problem], Thunk] | None = None
    torchao: Callable[[Problem], Thunk] | None = None
    flops: Callable[[Problem], int] | None = None
    mutates: tuple[int, ...] = ()
    specified: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] | None = None
    reference_tol: tuple[float, float] = (0.0, 0.0)
    bound: Callable[[Problem], tuple[torch.Tensor, torch.Tensor]] | None = None

    def op(self) -> Callable[..., Any]:
        """The public op itself, looked up by name."""
        import moe_kernels

        return getattr(moe_kernels, self.name)

    def thunk(self, problem: Problem) -> Thunk:
        """A call of the op on the problem's own tensors (what the benchmarks time)."""
        fn, args, kwargs = self.op(), problem.args, problem.kwargs
        return lambda: fn(*args, **kwargs)

    def outputs(self, fn: Callable[..., Any], problem: Problem) -> tuple[torch.Tensor, ...]:
        """Call ``fn`` like the op on fresh copies of the mutated arguments; the returned
        tensors and then the mutated arguments, restricted to the specified part."""
        args = list(problem.args)
        for i in self.mutates:
            args[i] = args[i].clone()
        result = fn(*args, **problem.kwargs)
        out = tensors(result) + tuple(args[i] for i in self.mutates)
        return self.specified(out) if self.specified is not None else out


def tensors(result: Any) -> tuple[torch.Tensor, ...]:
    """An op's result as a flat tuple of tensors (a NamedTuple's fields, a tensor, or none)."""
    if result is None:
        return ()
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(t for t in result if t is not None)


def interpreted(t: torch.Tensor) -> bool:
    """Whether ops on ``t``'s device run the Triton kernels in the interpreter (CPU tensors
    under ``TRITON_INTERPRET=1``): bf16 stores there truncate, fp8 casts may be a step off."""
    return execution_path(t.device) == "interpreter"


@functools.cache
def fbgemm_ops() -> Any:
    """``torch.ops.fbgemm`` once ``fbgemm_gpu.experimental.gen_ai.moe`` has registered FBGEMM's
    MoE ops; raises ImportError (or what the import raised) where fbgemm_gpu is missing."""
    import fbgemm_gpu.experimental.gen_ai.moe  # noqa: F401

    return torch.ops.fbgemm


# ----------------------------------------------------------------------------------------------
# comparisons

BF16_ULP = ULP[torch.bfloat16]  # relative size of one bf16 step (upper bound, normal numbers)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of the same width (bitwise comparison, NaN == NaN)."""
    if not t.is_floating_point():
        return t
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def bitwise_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Every tensor of ``a`` equals its partner in ``b`` bit for bit (shapes included)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True)
    )


def expect_equal(
    name: str, got: torch.Tensor, want: torch.Tensor, *, rel: float = 0.0, atol: float = 0.0
) -> float:
    """Same shape, and |got - want| <= rel * |want| + atol elementwise (0: equal values; NaNs
    must sit in the same places); returns the largest difference."""
    if tuple(got.shape) != tuple(want.shape):
        raise CheckFailed(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    g = got.detach().cpu()
    w = want.detach().cpu()
    if g.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        g = g.float()
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        w = w.float()
    g, w = g.double(), w.double()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        raise CheckFailed(f"{name}: NaN positions differ")
    g, w = torch.where(nan_g, 0.0, g), torch.where(nan_w, 0.0, w)
    diff = (g - w).abs()
    bad = diff > rel * w.abs() + atol
    if bool(bad.any()):
        n = int(bad.sum())
        raise CheckFailed(f"{name}: {n} of {bad.numel()} differ (max {float(diff.max()):.3g})")
    return float(diff.max()) if diff.numel() else 0.0


def expect_within(name: str, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    """|got - exact| <= bound elementwise (float64, shapes equal: ``bound_violations``, the rule
    the tests use); returns the largest error."""
    if tuple(got.shape) != tuple(exact.shape):
        raise CheckFailed(f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}")
    check = bound_violations(got, exact, bound)
    if check.bad:
        raise CheckFailed(
            f"{name}: {check.bad} of {check.total} out of bound ({check.largest_excess:.3g})"
        )
    return check.largest_error


def ulps(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step of ``dtype`` at the magnitude of each value of ``x64`` (float64; the smallest
    normal's step below it)."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    tiny = torch.finfo(dtype).tiny
    mag = x64.abs().clamp(min=tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mant)


# ----------------------------------------------------------------------------------------------
# random inputs


def randn(shape: Sequence[int], gen: torch.Generator, device: torch.device, dtype: torch.dtype):
    """Normal values drawn where ``gen`` lives (the GPU for the big shapes), then moved."""
    x = torch.randn(tuple(shape), generator=gen, device=gen.device, dtype=torch.float32)
    return x.to(device=device, dtype=dtype)


def softmax_scores(T: int, E: int, gen: torch.Generator, device: torch.device, dtype=None):
    """Router probabilities: the softmax of normal logits, (T, E) bf16 (or ``dtype``)."""
    logits = torch.randn(T, E, generator=gen, device=gen.device)
    return logits.softmax(dim=-1).to(device=device, dtype=dtype or torch.bfloat16)


def group_ends(
    rows: int, groups: int, gen: torch.Generator, device: torch.device, multiple: int = 32
) -> torch.Tensor:
    """(groups,) int32 distinct multiples of ``multiple`` ending at ``rows`` (a multiple of it)."""
    blocks = rows // multiple
    cut = torch.randperm(blocks - 1, generator=gen, device=gen.device)[: groups - 1] + 1
    ends = torch.cat([cut.sort().values, cut.new_full((1,), blocks)]) * multiple
    return ends.to(device=device, dtype=torch.int32)


def random_ends(rng: random.Random, rows: int, groups: int, tail: int = 0) -> list[int]:
    """``groups`` non-decreasing end offsets of row groups (empty groups allowed), the last one
    ``rows - tail``."""
    ends = sorted(rng.randint(0, rows - tail) for _ in range(groups - 1))
    return [*ends, rows - tail]
