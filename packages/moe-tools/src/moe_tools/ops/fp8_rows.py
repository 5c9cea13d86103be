"""Registry entries of FBGEMM's SwiGLU and row-wise FP8 ops: ``silu_mul``, ``silu_mul_quant``,
``gather_scale_quant_dense_tokens``.

The oracles compute in float64: SiLU-and-mul exactly (then a bound of the fp32 evaluation's
error: the GPU's ``ex2.approx`` and ``div.full`` are not IEEE), the row-wise quantisation by its
definition (``m = max(max |v|, 1e-12)`` bounded by scale_ub, ``scale = m / 448``, data the nearest
e4m3 value of ``v * 448 / m``; ``oracle_silu_mul_exact`` and ``oracle_e4m3`` of
``moe_kernels.testing``): the kernels' scales within 4 fp32 ulps of the exact one (plus the error
of their fp32 values), data within one e4m3 step, dead rows bitwise zero.
"""

from __future__ import annotations

import random
from functools import partial

import torch

from moe_kernels.testing import E4M3_STEP, oracle_e4m3, oracle_silu_mul_exact
from moe_tools.ops.spec import (
    CheckFailed,
    OpSpec,
    Problem,
    Sizes,
    bits,
    expect_within,
    randn,
    softmax_scores,
    ulps,
)
from moe_tools.ops.tokens import E_TOKENS, TOKEN_SIZES

U32 = 2.0**-24  # unit roundoff of fp32
FP8_MAX = 448.0
EPS32 = float(torch.tensor(1e-12, dtype=torch.float32))  # FBGEMM's floor on the row maximum
DTYPES = ("bfloat16", "float16", "float32")
# verify vs the reference where they are not bitwise equal by contract (both outputs of the quant
# ops get it): the data one e4m3 step (relative, or the subnormal step 2**-9 absolute, relative
# to the largest code 448) where the GPU's division moves a scale by an ulp or two; the oracle
# holds the scales themselves to a few ulps.
QUANT_REFERENCE_TOL = (E4M3_STEP, 2.0**-9 / FP8_MAX)


def fbgemm_fn(name: str):
    """FBGEMM's Python function of ``fbgemm_gpu.experimental.gen_ai.moe`` (its Triton ops: not
    all of them are registered under ``torch.ops.fbgemm``)."""
    import fbgemm_gpu.experimental.gen_ai.moe as fb

    return getattr(fb, name)


def _dtype(s: Sizes, key: str = "dtype", default: str = "bfloat16") -> torch.dtype:
    return getattr(torch, s.get(key, default))


def _count(s: Sizes, rows: int, device: torch.device) -> tuple[torch.Tensor | None, str]:
    """valid_token_count of the sizes' ``vtc`` (None, "partial": 2 rows / 3 + 1, "zero"), in the
    sizes' ``vtc_dtype``; and its label."""
    kind = s.get("vtc")
    if kind is None:
        return None, ""
    n = {"partial": 2 * rows // 3 + 1, "zero": 0}[kind]
    dtype = _dtype(s, "vtc_dtype", "int32")
    return torch.tensor([n], dtype=dtype, device=device), f" vtc={n}/{str(dtype)[6:]}"


def _ub(s: Sizes, device: torch.device) -> tuple[torch.Tensor | None, str]:
    ub = s.get("ub")
    if ub is None:
        return None, ""
    return torch.tensor([float(ub)], dtype=torch.float32, device=device), f" ub={ub}"


def _live(rows: int, vtc: torch.Tensor | None) -> torch.Tensor:
    """(rows,) bool: i < valid_token_count (all without one)."""
    n = rows if vtc is None else int(vtc.item())
    return torch.arange(rows) < n


# ----------------------------------------------------------------------------------------------
# the check of the float64 oracles


def check_fp8_rows(
    name: str,
    v: torch.Tensor,
    err_v: torch.Tensor,
    live: torch.Tensor,
    ub: torch.Tensor | None,
    data: torch.Tensor,
    scale: torch.Tensor,
) -> float:
    """Checks FBGEMM's row-wise FP8 quantisation of the exact float64 values ``v`` (N, D), which
    the kernel computes in fp32 within ``err_v`` (N, D) of them. Its row maximum is then within
    the row's largest ``err_v`` of the exact one, and its m within the floor and bound of that
    interval (exactly scale_ub where the interval lies above it). Live rows: the scale within
    4 fp32 ulps of ``m / 448`` (two divisions, ``div.full`` on the GPU) plus m's uncertainty
    over 448; data within one e4m3 step of the nearest e4m3 value of ``v * 448 / m`` (the
    kernel's product is a few fp32 ulps off: it may round the other way at a midpoint). Dead
    rows: bitwise zero. Returns the largest error."""
    N, D = v.shape
    if data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise CheckFailed(f"{name}: dtypes {data.dtype}, {scale.dtype}")
    if tuple(data.shape) != (N, D) or tuple(scale.shape) != (N,):
        raise CheckFailed(f"{name}: shapes {tuple(data.shape)}, {tuple(scale.shape)}")
    data, scale = data.cpu(), scale.cpu()
    dead = ~live
    if bool(bits(data)[dead].ne(0).any()) or bool(bits(scale)[dead].ne(0).any()):
        raise CheckFailed(f"{name}: dead rows not zero")
    amax = v.abs().amax(dim=1) if D else v.new_zeros(N)
    err_max = err_v.amax(dim=1) if D else err_v.new_zeros(N)
    ub64 = None if ub is None else torch.tensor(float(ub.item()), dtype=torch.float64)

    def row_max(a: torch.Tensor) -> torch.Tensor:  # the floor, then the bound
        a = a.clamp(min=EPS32)
        return a if ub64 is None else torch.minimum(a, ub64)

    m = row_max(amax)
    dm = torch.maximum(row_max(amax + err_max) - m, m - row_max((amax - err_max).clamp(min=0)))
    exact_scale = m / FP8_MAX
    bound = 4 * ulps(exact_scale, torch.float32) + dm / FP8_MAX
    scale_err = expect_within(f"{name} scale", scale[live], exact_scale[live], bound[live])
    q = oracle_e4m3(v * (FP8_MAX / m)[:, None])
    step = torch.exp2(torch.floor(torch.log2(q.abs().clamp(min=2.0**-6))) - 3)
    data_err = expect_within(f"{name} data", data.float()[live], q[live], step[live])
    return max(scale_err, data_err)


# ----------------------------------------------------------------------------------------------
# torch-native versions


def torch_quant_rows(v: torch.Tensor, ub: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The row-wise FP8 quantisation in plain torch ops (what the fused kernels replace)."""
    m = v.abs().amax(dim=1).clamp(min=1e-12)
    if ub is not None:
        m = torch.minimum(m, ub)
    s = FP8_MAX / m
    q = (v * s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, 1.0 / s


def torch_silu_mul(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    a = x0.float()
    return a * torch.sigmoid(a) * x1.float()


# ----------------------------------------------------------------------------------------------
# silu_mul and silu_mul_quant


def _draw_silu(rng: random.Random, large: bool) -> Sizes:
    return dict(
        T=rng.randint(1, 2048 if large else 96),
        D=rng.choice([64, 2048, 2050, 5120] if large else [1, 33, 130, 256]),
        dtype=rng.choice(DTYPES),
        layout=rng.choice(["halves", "contiguous"]),
        vtc=rng.choice([None, "partial", "zero"]),
        vtc_dtype=rng.choice(["int32", "int64"]),
        ub=rng.choice([None, 1200.0, 0.75]),
    )


def _make_silu(quant: bool):
    def make(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
        T, D, dtype = s["T"], s["D"], _dtype(s)
        layout = s.get("layout", "halves")
        if layout == "halves":  # FBGEMM's form: the column halves of one (T, 2D) tensor
            x = randn((T, 2 * D), gen, device, torch.float32).mul(2.0).to(dtype)
            x0, x1 = x[:, :D], x[:, D:]
        else:
            x0 = randn((T, D), gen, device, torch.float32).mul(2.0).to(dtype)
            x1 = randn((T, D), gen, device, torch.float32).mul(2.0).to(dtype)
        vtc, vtc_label = _count(s, T, device)
        label = f"T={T} D={D} {str(dtype)[6:]} {layout}{vtc_label}"
        if not quant:
            return Problem(label, s, (x0, x1, vtc))
        ub, ub_label = _ub(s, device)
        return Problem(label + ub_label, s, (x0, x1, ub, vtc))

    return make


def _silu_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """Live rows within 2 ulps of the output dtype (a rounding, or the interpreter's truncation)
    plus the fp32 evaluation's error of the exact value; dead rows bitwise +0."""
    x0, x1, vtc = p.args
    (y,) = out
    if y.dtype != x0.dtype or not y.is_contiguous():
        raise CheckFailed(f"output {y.dtype}, contiguous {y.is_contiguous()}")
    live = _live(x0.shape[0], vtc)
    if bool(bits(y.cpu())[~live].ne(0).any()):
        raise CheckFailed("dead rows not +0")
    exact, rel = oracle_silu_mul_exact(x0, x1)
    bound = 2 * ulps(exact, y.dtype) + rel * exact.abs()
    return expect_within("vs oracle", y.cpu()[live], exact[live], bound[live])


def _silu_quant_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    x0, x1, ub, vtc = p.args
    exact, rel = oracle_silu_mul_exact(x0, x1)
    err = rel * exact.abs()
    return check_fp8_rows("vs oracle", exact, err, _live(x0.shape[0], vtc), ub, *out)


def _ref_swiglu():
    from moe_kernels.reference import swiglu

    return swiglu


SILU_SIZES = {"quick": [dict(T=512, D=256)], "full": [dict(T=65536, D=2048)]}


def _elements(p: Problem) -> int:
    return p.args[0].numel()


SILU_MUL = OpSpec(
    name="silu_mul",
    sizes=SILU_SIZES,
    draw=_draw_silu,
    make=_make_silu(quant=False),
    reference=lambda x0, x1, valid_token_count=None: _ref_swiglu().silu_mul(
        x0, x1, valid_token_count
    ),
    oracle=_silu_oracle,
    bytes_moved=lambda p: 3 * _elements(p) * p.args[0].element_size(),
    native=lambda p: lambda: torch_silu_mul(p.args[0], p.args[1]).to(p.args[0].dtype),
    fbgemm=lambda ops, p: partial(fbgemm_fn("silu_mul"), *p.args),
    # the GPU's ex2.approx / div.full against torch's exp and IEEE division: a few fp32 ulps,
    # one ulp of a bf16 result; fp16 subnormals (absolute, relative to the largest value)
    reference_tol=(2.0**-7, 1e-7),
)

SILU_MUL_QUANT = OpSpec(
    name="silu_mul_quant",
    sizes={
        "quick": [dict(T=512, D=256)],
        "full": [dict(T=65536, D=2048, ub=1200.0)],
    },
    draw=_draw_silu,
    make=_make_silu(quant=True),
    reference=lambda x0, x1, scale_ub=None, valid_token_count=None: _ref_swiglu().silu_mul_quant(
        x0, x1, scale_ub, valid_token_count
    ),
    oracle=_silu_quant_oracle,
    bytes_moved=lambda p: (
        2 * _elements(p) * p.args[0].element_size() + _elements(p) + 4 * p.args[0].shape[0]
    ),
    native=lambda p: lambda: torch_quant_rows(torch_silu_mul(p.args[0], p.args[1]), p.args[2]),
    fbgemm=lambda ops, p: partial(fbgemm_fn("silu_mul_quant"), *p.args),
    reference_tol=QUANT_REFERENCE_TOL,
)


# ----------------------------------------------------------------------------------------------
# gather_scale_quant_dense_tokens


def _draw_gather(rng: random.Random, large: bool) -> Sizes:
    return dict(
        T=rng.randint(1, 2048 if large else 64),
        E=rng.choice([8, 16, 96]),
        k=rng.choice([1, 2, 4]),
        D=rng.choice([64, 2048, 2050] if large else [1, 33, 130]),
        dtype=rng.choice(DTYPES),
        index_dtype=rng.choice(["int32", "int64"]),
        dead=rng.choice([False, True]),
        vtc=rng.choice([None, "partial", "zero"]),
        vtc_dtype=rng.choice(["int32", "int64"]),
        ub=rng.choice([None, 1200.0, 0.05]),
    )


def _make_gather_quant(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    """FBGEMM's form: the rows of ``index_shuffling`` (expert-sorted); ``dead``: some indices -1
    (token or expert), as padded plans hold."""
    import moe_kernels

    T, k, D, E = s["T"], s["k"], s["D"], s.get("E", E_TOKENS)
    dtype, index_dtype = _dtype(s), _dtype(s, "index_dtype", "int32")
    scores = softmax_scores(T, E, gen, device)
    x = randn((T, D), gen, device, dtype)
    _, expert_idx, token_idx = moe_kernels.index_shuffling(scores, top_k=k)
    token_idx, expert_idx = token_idx.to(index_dtype), expert_idx.to(index_dtype)
    if s.get("dead", False):
        n = token_idx.shape[0]
        pick = torch.randint(0, 3, (2, n), generator=gen, device=gen.device).to(device)
        token_idx = torch.where(pick[0] == 0, -1, token_idx)
        expert_idx = torch.where(pick[1] == 0, -1, expert_idx)
    vtc, vtc_label = _count(s, token_idx.shape[0], device)
    ub, ub_label = _ub(s, device)
    label = f"T={T} k={k} D={D} E={E} {str(dtype)[6:]} {str(index_dtype)[6:]}"
    label += (" dead" if s.get("dead", False) else "") + vtc_label + ub_label
    return Problem(label, s, (x, token_idx, expert_idx, scores, ub, vtc))


def _gather_quant_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """v_i = x[tok_i] * scores[tok_i, exp_i] exactly (the kernel's one fp32 rounding: u |v|, or
    half the smallest subnormal); dead rows: an index -1 or i >= valid_token_count."""
    x, tok_i, exp_i, scores, ub, vtc = p.args
    tok, ex = tok_i.long().cpu(), exp_i.long().cpu()
    live = _live(tok.shape[0], vtc) & (tok >= 0) & (ex >= 0)
    t, e = tok.clamp(min=0), ex.clamp(min=0)
    v = x.double().cpu()[t] * scores.double().cpu()[t, e][:, None]
    v[~live] = 0.0
    return check_fp8_rows("vs oracle", v, U32 * v.abs() + 2.0**-150, live, ub, *out)


def _gather_quant_native(p: Problem):
    x, tok_i, exp_i, scores, ub, _ = p.args
    tok, ex = tok_i.long().clamp(min=0), exp_i.long().clamp(min=0)
    return lambda: torch_quant_rows(x.index_select(0, tok).float() * scores[tok, ex][:, None], ub)


def _gather_quant_reference(
    x, token_indices, expert_indices, scores, scale_ub=None, valid_token_count=None
):
    from moe_kernels.reference import gather_quant

    return gather_quant.gather_scale_quant_dense_tokens(
        x, token_indices, expert_indices, scores, scale_ub, valid_token_count
    )


def _gather_quant_bytes(p: Problem) -> int:
    """Rows read (x's dtype), data and scales written, the two indices and a score per row."""
    x, tok = p.args[0], p.args[1]
    N, D = tok.shape[0], x.shape[1]
    return N * D * x.element_size() + N * D + N * 4 + N * (2 * tok.element_size() + 2)


GATHER_SCALE_QUANT_DENSE_TOKENS = OpSpec(
    name="gather_scale_quant_dense_tokens",
    sizes=TOKEN_SIZES,
    draw=_draw_gather,
    make=_make_gather_quant,
    reference=_gather_quant_reference,
    oracle=_gather_quant_oracle,
    bytes_moved=_gather_quant_bytes,
    native=_gather_quant_native,
    fbgemm=lambda ops, p: partial(fbgemm_fn("gather_scale_quant_dense_tokens"), *p.args),
    reference_tol=QUANT_REFERENCE_TOL,
)

ENTRIES = (SILU_MUL, SILU_MUL_QUANT, GATHER_SCALE_QUANT_DENSE_TOKENS)
