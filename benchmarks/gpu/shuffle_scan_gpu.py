"""combine_shuffling at FBGEMM's padded case E 80 / dp 16 / 1 local expert: one-element scan
tiles failed Triton's compiler (ScanOpToLLVM assertion, Triton 3.6). Checks the GPU against the
CPU reference for one-rank and one-expert tiles.

    PYTHONPATH=packages/moe-kernels/src python3 benchmarks/gpu/shuffle_scan_gpu.py
"""

import torch

import moe_kernels as mk

g = torch.Generator().manual_seed(0)
for EP, E, start, end, T, D in [(16, 16, 15, 16, 32, 5120), (1, 4, 0, 1, 64, 256),
                                (1, 1, 0, 1, 16, 128), (16, 80, 5, 6, 64, 512)]:  # fmt: skip
    per = T // EP
    counts = torch.zeros(EP, E, dtype=torch.int32)
    for r in range(EP):  # rank r's rows split over random experts, at most T // EP in all
        left = int(torch.randint(0, per + 1, (1,), generator=g))
        for e in torch.randint(0, E, (left,), generator=g).tolist():
            counts[r, e] += 1
    x = torch.randn(T, D, generator=g).bfloat16()
    for padded in (True, False):
        try:
            got = mk.combine_shuffling(x.cuda(), counts.cuda(), start, end, padded)
            want = mk.combine_shuffling(x, counts, start, end, padded)
            ok = all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))
            print(f"EP={EP} E={E} [{start},{end}) T={T} padded={padded}: {'ok' if ok else 'DIFF'}")
        except Exception as exc:  # the failure is the result
            print(
                f"EP={EP} E={E} [{start},{end}) padded={padded}: FAIL {type(exc).__name__}: "
                f"{str(exc)[:200]}"
            )
