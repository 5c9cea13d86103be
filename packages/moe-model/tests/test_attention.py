"""``Attention`` (QK-norm + RoPE + KV write through ``moe_kernels.qk_norm_rope``) against the
formula it replaced, on the CPU: outputs and every cache element bit for bit, for each pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_model.attention import Attention
from moe_model.kv_cache import KVRingCache
from moe_model.rope import Rope3D, apply_rope


def old_forward(a: Attention, x_ND, cos_NP, sin_NP, cache, layer, bias_S, *, commit, kv_only):
    """Attention.forward before the fused op: torch QK-norm and RoPE, ``index_copy_`` writes
    (the former ``moe_model::kv_write``) of the scratch slot, then the ring slot after SDPA."""
    N = x_ND.shape[0]
    H, Hkv, Dh = a.n_heads, a.n_kv_heads, a.head_dim

    def write(slot, k_HND, v_HND):
        cache.k[layer].index_copy_(1, slot, k_HND.unsqueeze(1))
        cache.v[layer].index_copy_(1, slot, v_HND.unsqueeze(1))

    ring = torch.remainder(cache.frame, cache.window).view(1)
    k_NHD = apply_rope(a.k_norm(a.k_proj(x_ND).view(N, Hkv, Dh)), cos_NP, sin_NP)
    k_HND = k_NHD.transpose(0, 1)
    v_HND = a.v_proj(x_ND).view(N, Hkv, Dh).transpose(0, 1)
    if kv_only:
        write(ring, k_HND, v_HND)
        return None
    q_NHD = apply_rope(a.q_norm(a.q_proj(x_ND).view(N, H, Dh)), cos_NP, sin_NP)
    write(cache.scratch_slot, k_HND, v_HND)
    k_HSD, v_HSD = cache.layer_kv(layer)
    G = H // Hkv
    q_HMD = q_NHD.view(N, Hkv, G, Dh).permute(1, 2, 0, 3).reshape(Hkv, G * N, Dh)
    o_HMD = F.scaled_dot_product_attention(
        q_HMD[None],
        k_HSD[None],
        v_HSD[None],
        attn_mask=None if bias_S is None else bias_S.view(1, 1, 1, -1),
    )[0]
    o_ND = o_HMD.view(Hkv, G, N, Dh).permute(2, 0, 1, 3).reshape(N, H * Dh)
    if commit:
        write(ring, k_HND, v_HND)
    return a.o_proj(o_ND)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frame", [1, 5], ids=["filling", "full"])
def test_attention_equals_the_former_formula(dtype, frame):
    """Every pass kind at a frame while the ring fills (masked) and once it is full (the ring
    slot written by the commit still holds the frame ``window`` back while the frame attends)."""
    torch.manual_seed(0)
    d_model, H, Hkv, N, W, L = 64, 4, 2, 12, 3, 2
    attn = Attention(d_model, H, Hkv).to(dtype).requires_grad_(False)
    with torch.no_grad():  # scales away from 1, so the norm's weights matter
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    rope = Rope3D(d_model // H, 3, 4)
    new = KVRingCache(L, Hkv, W, N, d_model // H, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    for t in (new.k, new.v):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))  # a history in every slot
    new.frame.fill_(frame)
    old = KVRingCache(L, Hkv, W, N, d_model // H, dtype=dtype)
    for name in ("k", "v", "frame"):
        getattr(old, name).copy_(getattr(new, name))
    cos, sin = rope(new.frame)
    x = torch.randn(N, d_model, generator=g).to(dtype)
    bias = new.attn_bias(dtype) if frame < W else None
    passes = [
        dict(layer=0, commit=False, kv_only=False),  # denoise
        dict(layer=0, commit=True, kv_only=False),  # cache pass, a layer before the last
        dict(layer=1, commit=True, kv_only=True),  # cache pass, the last layer
    ]
    for kw in passes:
        got = attn(x, [(cos, sin)], new, kw["layer"], [bias], commit=kw["commit"],
                   kv_only=kw["kv_only"])  # fmt: skip
        want = old_forward(attn, x, cos, sin, old, kw["layer"], bias, commit=kw["commit"],
                           kv_only=kw["kv_only"])  # fmt: skip
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want), kw
        assert torch.equal(new.k, old.k) and torch.equal(new.v, old.v), kw
        x = torch.randn(N, d_model, generator=g).to(dtype)


@pytest.mark.parametrize("kv_only", [False, True], ids=["layer", "last layer"])
@pytest.mark.parametrize("frame", [1, 3, 5], ids=["filling", "just full", "full"])
def test_commit_and_next_pass_equal_the_passes_one_after_the_other(frame, kv_only):
    """Two passes in one call (pass 0 commits, pass 1 one frame later sees the commit): the same
    outputs and cache as the former formula run pass by pass, the counter advanced between."""
    torch.manual_seed(0)
    d_model, H, Hkv, N, W, L = 64, 4, 2, 12, 3, 2
    attn = Attention(d_model, H, Hkv).requires_grad_(False)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    rope = Rope3D(d_model // H, 3, 4)
    new = KVRingCache(L, Hkv, W, N, d_model // H, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    for t in (new.k, new.v):
        t.copy_(torch.randn(t.shape, generator=g))
    new.frame.fill_(frame)
    old = KVRingCache(L, Hkv, W, N, d_model // H, dtype=torch.float32)
    for name in ("k", "v", "frame"):
        getattr(old, name).copy_(getattr(new, name))
    before = new.k.clone()
    x = torch.randn(2 * N, d_model, generator=g)
    ropes = [rope(new.frame), rope(new.frame + 1)]
    biases = [new.attn_bias(torch.float32, ahead=p) for p in (0, 1)]
    got = attn(x, ropes, new, 1, biases, commit=True, kv_only=kv_only)
    first = old_forward(attn, x[:N], *ropes[0], old, 1, old.attn_bias(torch.float32),
                        commit=True, kv_only=kv_only)  # fmt: skip
    old.frame.add_(1)
    second = old_forward(attn, x[N:], *ropes[1], old, 1, old.attn_bias(torch.float32),
                         commit=False, kv_only=False)  # fmt: skip
    want = second if kv_only else torch.cat([first, second])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new.k, old.k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new.v, old.v, atol=1e-6, rtol=1e-6)
    assert not torch.equal(new.k[1, :, frame % W], before[1, :, frame % W])  # the commit
