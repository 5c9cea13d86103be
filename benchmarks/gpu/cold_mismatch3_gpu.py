"""Which op of ``_mxfp8_train.padded_rows`` Inductor compiles wrong on CUDA (issue 44 run).

python3 benchmarks/gpu/cold_mismatch3_gpu.py
"""

import torch

BLOCK = 32
M, E, rows = 256, 8, 32
ends = (torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows).contiguous()
Mp = (M + (BLOCK - 1) * E) // BLOCK * BLOCK


def starts_of(offsets):
    e = offsets.to(torch.int64).clamp(0, M)
    b = torch.cat([e.new_zeros(1), e[:-1]])
    sizes = e - b
    return torch.cat([e.new_zeros(1), torch.cumsum((sizes + BLOCK - 1) // BLOCK * BLOCK, 0)])


def ss(offsets):
    s = starts_of(offsets)
    r = torch.arange(Mp, device=offsets.device, dtype=torch.int64)
    return torch.searchsorted(s[1:], r, right=True)


def ss_contig(offsets):
    s = starts_of(offsets)[1:].contiguous()
    r = torch.arange(Mp, device=offsets.device, dtype=torch.int64)
    return torch.searchsorted(s, r, right=True)


def ss_input(s):
    r = torch.arange(Mp, device=s.device, dtype=torch.int64)
    return torch.searchsorted(s[1:], r, right=True)


def counted(offsets):  # number of group ends <= r, by a scatter of ones and a prefix sum
    s = starts_of(offsets)
    marks = torch.zeros(Mp + 1, device=offsets.device, dtype=torch.int64)
    marks = marks.index_add(0, s[1:].clamp(max=Mp), torch.ones_like(s[1:]))
    return marks.cumsum(0)[:Mp]


def amax_scan(offsets):  # group e + 1 marked at its padded end, then a running maximum
    s = starts_of(offsets)
    ids = torch.arange(1, E + 1, device=offsets.device, dtype=torch.int64)
    marks = torch.zeros(Mp + 1, device=offsets.device, dtype=torch.int64)
    marks = marks.scatter_reduce(0, s[1:].clamp(max=Mp), ids, "amax")
    return marks.cummax(0).values[:Mp]


def cmp_sum(offsets):
    s = starts_of(offsets)
    r = torch.arange(Mp, device=offsets.device, dtype=torch.int64)
    return (r[:, None] >= s[None, 1:]).sum(1)


want = cmp_sum(ends)
for name, fn, arg in [
    ("searchsorted(in-graph slice)", ss, ends),
    ("searchsorted(contiguous)", ss_contig, ends),
    ("searchsorted(input slice)", ss_input, starts_of(ends)),
    ("index_add+cumsum", counted, ends),
    ("scatter amax+cummax", amax_scan, ends),
    ("compare+sum", cmp_sum, ends),
]:
    torch._dynamo.reset()
    c = torch.compile(fn, fullgraph=True)(arg)
    e = fn(arg)
    print(
        f"{name}: eager==oracle {torch.equal(e, want)}, compiled==oracle {torch.equal(c, want)}; "
        f"compiled[:40:4] {c[:40:4].tolist()}",
        flush=True,
    )
