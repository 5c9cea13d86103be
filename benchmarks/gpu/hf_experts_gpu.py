"""transformers' Qwen3-MoE sparse block on each experts backend (``moe_model.hf``): forward, and
forward + backward, at Qwen3-30B-A3B's MoE sizes (d 2048, 128 experts of 768, top-8), bf16,
8192 tokens; then ``generate`` of a 2-layer model of those sizes at batch 1 and 32.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/hf_experts_gpu.py [--tokens 8192,1024] [--no-generate] [--dry-run]

Backends: HF's ``grouped_mm`` (its default), ``eager`` (its per-expert loop; forward only, up to
1024 tokens), ours (``moe_kernels``), ``blocks`` (not a backend: ``replace_moe_blocks``, our
routing too); ``sonicmoe`` / ``deepgemm`` where they load. Medians of
``do_bench`` (ms), max |difference| from ``grouped_mm``'s output in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import moe_model.hf as hf
from moe_tools.timing import bench_us

QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True)  # fmt: skip


BLOCKS = "blocks"  # not a backend: replace_moe_blocks, our routing and experts (MoEBlock)


def block(config, impl: str, device, dtype):
    config._experts_implementation = "eager" if impl == BLOCKS else impl
    torch.manual_seed(0)
    b = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.02)
    return hf.MoEBlock(b) if impl == BLOCKS else b


def time_block(config, impls, T, device, dtype) -> None:
    x = torch.randn(1, T, config.hidden_size, device=device, dtype=dtype)
    ref = None
    print(f"# Qwen3MoeSparseMoeBlock, {T} tokens, {dtype}: ms (median)")
    print(f"{'backend':14s} {'forward':>9s} {'fwd+bwd':>9s} {'vs grouped_mm':>14s} {'max|dy|':>9s}")
    base = {}
    for impl in impls:
        try:
            b = block(config, impl, device, dtype)
            with torch.no_grad():
                y = b(x)

            def forward(b=b):
                with torch.no_grad():
                    return b(x)

            fwd = bench_us(forward, device) / 1e3
            xg = x.detach().requires_grad_()
            g = torch.randn_like(y)

            def step(b=b, xg=xg, g=g):
                b.zero_grad(set_to_none=True)
                b(xg).backward(g)

            both = bench_us(step, device) / 1e3 if impl != "eager" else float("nan")
        except Exception as e:  # a backend that does not load here
            print(f"{impl:14s} unavailable: {type(e).__name__}: {str(e)[:80]}")
            continue
        ref = y.float() if ref is None else ref
        base.setdefault("fwd", fwd)
        base.setdefault("both", both)
        diff = (y.float() - ref).abs().max().item()
        ratio = f"{base['fwd'] / fwd:.2f}x / {base['both'] / both:.2f}x"
        print(f"{impl:14s} {fwd:9.3f} {both:9.3f} {ratio:>14s} {diff:9.2e}")


def time_generate(config, impls, batch, device, dtype, new_tokens=16) -> None:
    cfg = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B, vocab_size=1024, intermediate_size=6144,
                                      num_hidden_layers=2, num_attention_heads=32,
                                      num_key_value_heads=4, head_dim=128)  # fmt: skip
    ids = torch.randint(0, 1024, (batch, 16), device=device)
    for impl in impls:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, experts_implementation="eager" if impl == BLOCKS else impl
        ).to(device)
        if impl == BLOCKS:
            hf.replace_moe_blocks(model)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        out = model.generate(ids, **kw)  # warm-up
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        sync()
        ms = (time.perf_counter() - t0) / new_tokens * 1e3
        print(
            f"generate batch {batch:3d} {impl:12s} {ms:7.3f} ms/token  last {out[0, -4:].tolist()}"
        )
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,1024", help="block sizes, comma-separated")
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, fp32")
    args = ap.parse_args()
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32,
                                             num_experts=8, num_experts_per_tok=2)  # fmt: skip
        impls, sizes = ["grouped_mm", hf.BACKEND, BLOCKS], [64]
        time_generate(config, impls, 2, device, dtype, new_tokens=4)
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        config = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B)
        impls = ["grouped_mm", hf.BACKEND, BLOCKS, "sonicmoe", "deepgemm"]
        sizes = [int(t) for t in args.tokens.split(",")]
    for T in sizes:
        time_block(config, impls + (["eager"] if T <= 1024 else []), T, device, dtype)
    if not args.dry_run and not args.no_generate:
        for batch in (1, 32):
            time_generate(config, ["grouped_mm", hf.BACKEND, BLOCKS], batch, device, dtype)
    print("OK")


if __name__ == "__main__":
    main()
