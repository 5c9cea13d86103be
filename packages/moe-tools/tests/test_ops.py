"""The op registry: it covers moe_kernels' public API, and each entry's parts do what they say
(reference adapter, independent oracle, torch-native peer, bytes moved), on CPU."""

from __future__ import annotations

import random

import pytest
import torch

import moe_kernels
from moe_tools.ops import REGISTRY, RESULT_TYPES, SIZE_CLASSES, CheckFailed, missing_ops
from moe_tools.ops import mxfp8 as ops_mxfp8
from moe_tools.ops.spec import bitwise_equal, expect_equal, expect_within, tensors

CPU = torch.device("cpu")
NAMES = list(REGISTRY)


def test_registry_covers_every_public_name_of_moe_kernels():
    """A public op without an entry fails here: adding an op to moe_kernels.__all__ means adding
    its registry entry (and so verify and kernels cover it by construction)."""
    assert missing_ops() == []
    assert set(REGISTRY) | set(RESULT_TYPES) == set(moe_kernels.__all__)
    for name, spec in REGISTRY.items():
        assert spec.name == name and callable(getattr(moe_kernels, name))


@pytest.mark.parametrize("type_name", list(RESULT_TYPES))
def test_result_types_are_what_their_op_returns(type_name):
    spec = REGISTRY[RESULT_TYPES[type_name]]
    p = spec.make(spec.sizes["quick"][0], torch.Generator().manual_seed(0), CPU)
    assert isinstance(spec.thunk(p)(), getattr(moe_kernels, type_name))


def _problem(name: str, seed: int = 0, sizes=None):
    spec = REGISTRY[name]
    sizes = sizes if sizes is not None else spec.sizes["quick"][0]
    return spec, spec.make(sizes, torch.Generator().manual_seed(seed), CPU)


@pytest.mark.parametrize("name", NAMES)
def test_entry_shapes_and_bytes(name):
    spec = REGISTRY[name]
    for cls in SIZE_CLASSES:
        assert spec.sizes[cls], (name, cls)
    spec, p = _problem(name)
    assert spec.bytes_moved(p) > 0
    assert spec.flops is None or spec.flops(p) > 0
    assert p.label
    big = spec.draw(random.Random(0), True)  # CUDA's verify sizes: drawn, not built here
    assert isinstance(big, dict) and big


@pytest.mark.parametrize("name", NAMES)
def test_reference_oracle_and_native_agree_with_the_op(name):
    """On the CPU the op runs its reference: the entry's reference adapter must give the same
    bits, the oracle must accept it, and the torch-native peer must run."""
    spec = REGISTRY[name]
    rng = random.Random(1)
    for i, sizes in enumerate([spec.sizes["quick"][0], *(spec.draw(rng, False) for _ in range(3))]):
        spec, p = _problem(name, i, sizes)
        out = spec.outputs(spec.op(), p)
        assert out and all(isinstance(t, torch.Tensor) for t in out)
        assert bitwise_equal(out, spec.outputs(spec.reference, p)), p.label
        assert spec.oracle(p, out) >= 0.0
    if spec.native is not None:
        tensors(spec.native(p)())


def _corrupt(out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The same outputs with one element of the largest one changed."""
    i = max(range(len(out)), key=lambda j: out[j].numel())
    bad = out[i].clone()
    flat = bad.view(-1) if bad.is_contiguous() else bad.reshape(-1)
    if bad.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        flat.view(torch.uint8)[0] ^= 0x11
    elif bad.is_floating_point():
        flat[0] = flat[0] * 1.5 + 1.0
    else:
        flat[0] += 1
    if not bad.is_contiguous():
        bad = flat.view(bad.shape)
    return out[:i] + (bad,) + out[i + 1 :]


@pytest.mark.parametrize("name", NAMES)
def test_oracle_rejects_a_wrong_output(name):
    """Every oracle can fail: a changed element of the op's output is caught."""
    spec, p = _problem(name)
    out = spec.outputs(spec.op(), p)
    with pytest.raises(CheckFailed):
        spec.oracle(p, _corrupt(out))


def test_native_peers_compute_what_the_op_computes():
    """Where the torch-native peer computes the same function, the speedup compares like with
    like."""
    for name in ("dispatch", "combine", "gather_scale_dense_tokens", "expert_activation",
                 "router_scores", "from_mxfp8", "to_blocked", "to_blocked_per_group_3d",
                 "gather_grouped_mm", "grouped_weight_grad"):  # fmt: skip
        spec, p = _problem(name)
        ours, native = spec.outputs(spec.op(), p)[0], tensors(spec.native(p)())[0]
        if ours.dtype == torch.float8_e8m0fnu:  # scale bytes: 255 is NaN
            assert bitwise_equal((ours,), (native,)), name
        else:
            torch.testing.assert_close(ours.float(), native.float(), rtol=1e-2, atol=1e-2, msg=name)
    spec, p = _problem("route")  # same pairs up to ties between equal bf16 scores
    plan = spec.thunk(p)()
    counts = spec.native(p)()[0]
    assert int(counts.sum()) == int(plan.counts.sum())
    assert int((plan.counts.long() - counts).abs().sum()) <= 0.02 * int(counts.sum())


def test_mutating_ops_get_fresh_copies():
    spec, p = _problem("scatter_add_dense_tokens")
    before = p.args[0].clone()
    a, b = spec.outputs(spec.op(), p), spec.outputs(spec.op(), p)
    assert torch.equal(p.args[0], before)  # the problem's own tensor is untouched
    assert bitwise_equal(a, b)


def test_expect_equal_and_within():
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert expect_equal("x", a, a.clone()) == 0.0
    with pytest.raises(CheckFailed, match="1 of 3 differ"):
        expect_equal("x", a, torch.tensor([1.0, 2.5, float("nan")]))
    with pytest.raises(CheckFailed, match="NaN"):
        expect_equal("x", a, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(CheckFailed, match="shape"):
        expect_equal("x", a, a[:2])
    assert expect_equal("x", torch.tensor([1.0]), torch.tensor([1.005]), rel=0.01) > 0
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert expect_within("y", torch.tensor([1.0, 2.1]), exact, torch.tensor([0.0, 0.2])) > 0
    with pytest.raises(CheckFailed, match="out of bound"):
        expect_within("y", torch.tensor([1.0, float("nan")]), exact, torch.ones(2))


def test_oracle_blocked_layout_by_hand():
    s = torch.arange(130 * 5, dtype=torch.int32).remainder(251).to(torch.uint8).view(130, 5)
    out = ops_mxfp8.oracle_blocked(s).flatten()
    assert out.shape == (256 * 8,)
    assert int(out[0]) == int(s[0, 0])
    assert int(out[1]) == int(s[0, 1])  # columns inside a tile are adjacent
    assert int(out[4]) == int(s[32, 0])  # row 32 is the second 32-row slab: offset 4
    assert int(out[16]) == int(s[1, 0])  # row 1: offset 16
    assert int(out[512]) == int(s[0, 4])  # second column tile of the first row tile
    assert int(out[2 * 512]) == int(s[128, 0])  # first tile of the second row tile
    assert int(out[512 + 1]) == 0  # padding column 5 of row 0


def test_oracle_mxfp8_by_hand():
    from moe_kernels.testing import oracle_e4m3, oracle_mxfp8_scale

    x = torch.zeros(4, 32)
    x[0, 3], x[1, 0], x[2, 5] = 448.0, -449.0, 1.0
    assert oracle_mxfp8_scale(x).tolist() == [[127], [128], [119], [0]]
    # e4m3: 3 mantissa bits, ties to even, subnormal step 2**-9, saturating at 448
    v = torch.tensor([1.0625, 1.1875, 2.0**-9 * 1.5, 500.0, -3.3], dtype=torch.float64)
    assert oracle_e4m3(v).tolist() == [1.0, 1.25, 2.0**-8, 448.0, -3.25]
