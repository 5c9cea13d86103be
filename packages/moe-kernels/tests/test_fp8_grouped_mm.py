"""``fp8_grouped_mm`` (e4m3 rows with per-row scales times e4m3 expert weights with per-channel or
128 x 128 block scales) against a float64 oracle written out from the fp8 values and the scales,
on the reference path and in the interpreter; ``quantize_fp8_weights`` against the e4m3 rounding
bound; tail and sentinel rows, repeatability, no graph break, bad arguments."""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference.fp8_rowwise import quantize_rows
from moe_kernels.testing import ULP, execution_path

E4M3 = torch.float8_e4m3fn


def oracle(xq, xs, wq, ws, offsets, rows):
    """float64: y[p] = sum_k x[r, k] w[e, n, k] s_w(e, n, k) * s_x[r], loops over the groups."""
    T = xq.shape[0]
    E, N, D = wq.shape
    P = T if rows is None else rows.shape[0]
    src = torch.arange(P) if rows is None else rows.long()
    y = torch.zeros(P, N, dtype=torch.float64)
    bounds = [0] + [min(max(int(b), 0), P) for b in offsets.tolist()[1:]]
    for e in range(E):
        if ws.dim() == 3:  # each weight element times its block's scale
            s = ws[e].double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :D]
        else:
            s = ws[e].double()[:, None].expand(N, D)
        w = wq[e].double() * s
        for p in range(bounds[e], bounds[e + 1]):
            r = int(src[p])
            if 0 <= r < T:
                y[p] = (xq[r].double() @ w.T) * float(xs[r])
    return y


def problem(T, E, D, N, k, block, seed=0, gathered=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w = torch.randn(E, N, D, generator=g) / D**0.5
    xq, xs = quantize_rows(x, None, None)
    wq = mk.quantize_fp8_weights(w, block=block)
    if gathered:
        plan = mk.route(torch.randn(T, E, generator=g).softmax(-1), k)
        return xq, xs, wq, plan.offsets, plan.token_indices
    ends = sorted(torch.randint(0, T + 1, (E,), generator=g).tolist())
    return xq, xs, wq, torch.tensor([0, *ends], dtype=torch.int32), None


CASES = [  # T, E, D, N, k, block, gathered
    (40, 4, 256, 96, 2, False, True),
    (40, 4, 256, 96, 2, True, True),
    (7, 3, 200, 40, 1, True, True),  # D and N not multiples of 128: partial scale blocks
    (33, 5, 384, 160, 3, False, False),  # sorted rows, a tail past offsets[E]
]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_float64_oracle(case, out_dtype):
    T, E, D, N, k, block, gathered = case
    xq, xs, wq, offsets, rows = problem(T, E, D, N, k, block, gathered=gathered)
    if rows is not None:
        rows = rows.clone()
        rows[::5] = -1  # sentinel rows: zero
    y = mk.fp8_grouped_mm(xq, xs, wq.weight, wq.scale, offsets, rows, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (T * k if gathered else T, N)
    want = oracle(xq, xs, wq.weight, wq.scale, offsets, rows)
    mag = oracle(xq.float().abs().to(E4M3), xs, wq.weight.float().abs().to(E4M3),
                 wq.scale, offsets, rows)  # fmt: skip
    ulp = ULP[out_dtype]  # one full step: the interpreter truncates bf16 stores
    err = (y.double() - want).abs()
    assert (err <= ulp * want.abs() + 1e-5 * mag + 1e-30).all(), err.max().item()
    assert torch.equal(y, mk.fp8_grouped_mm(xq, xs, wq.weight, wq.scale, offsets, rows,
                                            out_dtype=out_dtype))  # fmt: skip


def test_strided_row_scales_read_as_their_values():
    """x_scale as a strided view (every other element of a wider tensor) gives the same bits
    as its contiguous copy (the kernels once read it with unit stride: another row's scale)."""
    xq, xs, wq, offsets, rows = problem(40, 4, 256, 96, 2, False)
    wide = torch.stack([xs, torch.full_like(xs, 7.0)], dim=1)
    got = mk.fp8_grouped_mm(xq, wide[:, 0], wq.weight, wq.scale, offsets, rows)
    assert torch.equal(got, mk.fp8_grouped_mm(xq, xs, wq.weight, wq.scale, offsets, rows))


INTERPRETED = execution_path(torch.device("cpu")) == "interpreter"
if INTERPRETED:  # (a module-level kernel: the interpreter resolves names in its globals)
    import triton
    import triton.language as tl

    from moe_kernels._triton.fp8_grouped_mm import e4m3_value

    @triton.jit
    def _decode_bytes(b_ptr, o_ptr):
        i = tl.arange(0, 256)
        tl.store(o_ptr + i, e4m3_value(tl.load(b_ptr + i)))


@pytest.mark.skipif(not INTERPRETED, reason="the Triton launcher on CPU: TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decoded_kernel_matches_float64_oracle(case):
    """The GEMM plan's "triton_fp8_decoded" (GPUs before sm_89): the kernel reads the operands'
    bytes and decodes them (``e4m3_value``) instead of using the e4m3 type; the same bound."""
    from moe_kernels._triton import fp8_grouped_mm as tri

    T, E, D, N, k, block, gathered = case
    xq, xs, wq, offsets, rows = problem(T, E, D, N, k, block, gathered=gathered)
    y = tri.fp8_grouped_mm(xq, xs, wq.weight, wq.scale, offsets, rows, torch.float32, decode=True)
    want = oracle(xq, xs, wq.weight, wq.scale, offsets, rows)
    mag = oracle(xq.float().abs().to(E4M3), xs, wq.weight.float().abs().to(E4M3),
                 wq.scale, offsets, rows)  # fmt: skip
    err = (y.double() - want).abs()
    assert (err <= ULP[torch.float32] * want.abs() + 1e-5 * mag + 1e-30).all(), err.max().item()


@pytest.mark.skipif(not INTERPRETED, reason="a Triton function on CPU: TRITON_INTERPRET=1")
def test_e4m3_bytes_decode_exactly():
    """Every one of the 256 e4m3fn bytes decodes to torch's value (NaN for 0x7F and 0xFF)."""
    b = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256)
    _decode_bytes[(1,)](b, got)
    want = b.view(E4M3).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("block", [False, True])
def test_quantize_weights_within_e4m3_rounding(block):
    w = torch.randn(3, 200, 136, generator=torch.Generator().manual_seed(1))
    w[1, 7] = 0  # an all-zero output channel: scale 1, zeros
    q = mk.quantize_fp8_weights(w, block=block)
    assert q.weight.dtype == E4M3
    if block:
        assert q.scale.shape == (3, 2, 2)
        s = q.scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :136]
    else:
        assert q.scale.shape == (3, 200)
        s = q.scale[:, :, None]
    deq = q.weight.float() * s
    # e4m3: 3 mantissa bits, relative rounding <= 2^-4; values below 2^-6 of the scale's range
    # are subnormal: absolute error <= 2^-10 of the scale times 448
    bound = 2.0**-4 * w.abs() + 2.0**-9 * 448 * s
    assert ((deq - w).abs() <= bound).all()
    assert (q.weight[1, 7].float() == 0).all()
    assert torch.equal(q.dequantize(), deq)  # the NamedTuple's own dequantisation
    assert torch.equal(q.dequantize(torch.bfloat16), deq.bfloat16())
    # a few experts at a time (a large layer's bounded temporaries): the same bits
    from moe_kernels.reference.fp8_grouped_mm import quantize_fp8_weights

    q1, s1 = quantize_fp8_weights(w, block, chunk_elements=200 * 136)  # one expert a chunk
    assert torch.equal(q1.view(torch.uint8), q.weight.view(torch.uint8))
    assert torch.equal(s1, q.scale)


def test_no_graph_break():
    xq, xs, wq, offsets, rows = problem(16, 4, 128, 32, 2, False)
    fn = torch.compile(lambda *a: mk.fp8_grouped_mm(*a), fullgraph=True)
    torch._dynamo.reset()
    got = fn(xq, xs, wq.weight, wq.scale, offsets, rows)
    torch._dynamo.reset()
    assert torch.equal(got, mk.fp8_grouped_mm(xq, xs, wq.weight, wq.scale, offsets, rows))


def test_bad_arguments_name_the_argument():
    xq, xs, wq, offsets, rows = problem(8, 2, 128, 32, 1, False)
    args = (xq, xs, wq.weight, wq.scale, offsets, rows)
    with pytest.raises(TypeError, match="x_TD"):
        mk.fp8_grouped_mm(xq.float(), *args[1:])
    with pytest.raises(TypeError, match="w_END"):
        mk.fp8_grouped_mm(xq, xs, wq.weight.float(), *args[3:])
    with pytest.raises(ValueError, match="w_scale"):
        mk.fp8_grouped_mm(*args[:3], wq.scale[:, :5], *args[4:])
    with pytest.raises(ValueError, match="x_scale"):
        mk.fp8_grouped_mm(xq, xs[:3], *args[2:])
    with pytest.raises(TypeError, match="out_dtype"):
        mk.fp8_grouped_mm(*args, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets"):
        mk.fp8_grouped_mm(*args[:4], offsets[:-1], rows)
    with pytest.raises(TypeError, match="block"):
        mk.quantize_fp8_weights(wq.weight.float(), block=1)
