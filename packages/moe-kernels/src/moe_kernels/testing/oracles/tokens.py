"""Token-movement oracles: gather / scatter / dispatch / combine as Python loops over rows in the
ops' own precision (fp32 arithmetic, one rounding to the output dtype: bit-exact expectations),
combine's sum in float64, the expert-parallel shuffles as chunk walks copying rows, and the
padded scatter-add as its sequential loop (plus FBGEMM's own test references)."""

from __future__ import annotations

import torch

__all__ = [
    "oracle_combine",
    "oracle_combine_f64",
    "oracle_dispatch",
    "oracle_fbgemm_combine_shuffling",
    "oracle_fbgemm_scatter_add_padded",
    "oracle_gather_scale",
    "oracle_scatter_add",
    "oracle_scatter_add_padded",
    "oracle_shuffle",
    "oracle_shuffle_chunks",
    "oracle_shuffle_counts",
]

# ----------------------------------------------------------------------------------------------
# gather / scatter / dispatch / combine


def oracle_gather_scale(x, tok, exp, scores, vtc=None):
    """``gather_scale_dense_tokens``: row i = x[tok[i]] * scores[tok[i], exp[i]] in fp32, rounded
    to x's dtype; rows with tok < 0 or i >= vtc (a 1-element tensor) zero."""
    out = torch.zeros(tok.shape[0], x.shape[1], dtype=x.dtype)
    limit = tok.shape[0] if vtc is None else int(vtc.reshape(()))
    for i in range(min(limit, tok.shape[0])):
        t, e = int(tok[i]), int(exp[i])
        if t >= 0:
            out[i] = (x[t].float() * scores[t, e].float()).to(x.dtype)
    return out


def oracle_scatter_add(out, src, tok, vtc=None):
    """``scatter_add_dense_tokens`` on a copy of ``out``: rows i in ascending order (i < vtc,
    tok[i] >= 0), each out[tok[i]] += src[i] in fp32 rounded to out's dtype."""
    out = out.clone()
    limit = tok.shape[0] if vtc is None else int(vtc.reshape(()))
    for i in range(min(limit, tok.shape[0])):
        t = int(tok[i])
        if t >= 0:
            out[t] = (out[t].float() + src[i].float()).to(out.dtype)
    return out


def oracle_dispatch(x, plan, scale):
    """``dispatch``: row p = x[token_indices[p]] (times weights[p] in fp32, rounded to x's dtype,
    when ``scale``); rows with token -1 zero."""
    out = torch.zeros(plan.token_indices.shape[0], x.shape[1], dtype=x.dtype)
    for p, t in enumerate(plan.token_indices.tolist()):
        if t >= 0:
            out[p] = (x[t].float() * plan.weights[p]).to(x.dtype) if scale else x[t]
    return out


def oracle_combine(y, plan, weighted, out_dtype):
    """``combine``: token t = the fp32 sum over its choices j (in order, inverse[t, j] >= 0) of
    (weights[p] *) y[p], p = inverse[t, j], rounded to ``out_dtype``."""
    num_tokens, k = plan.inverse.shape
    out = torch.zeros(num_tokens, y.shape[1])
    for t in range(num_tokens):
        acc = torch.zeros(y.shape[1])
        for j in range(k):
            p = int(plan.inverse[t, j])
            if p >= 0:
                term = y[p].float()
                acc = acc + (plan.weights[p] * term if weighted else term)
        out[t] = acc
    return out.to(out_dtype)


def oracle_combine_f64(y, token_indices, weights, num_tokens: int) -> torch.Tensor:
    """``combine`` (weighted) in float64 on the CPU: a naive loop over the pairs p, each
    out[token_indices[p]] += weights[p] * y[p] (pairs with token -1 add nothing)."""
    T, D = num_tokens, y.shape[1]
    want = torch.zeros(T, D, dtype=torch.float64)
    tok, w, yd = token_indices.long().cpu(), weights.double().cpu(), y.double().cpu()
    for i in range(tok.shape[0]):
        if tok[i] >= 0:
            want[tok[i]] += w[i] * yd[i]
    return want


# ----------------------------------------------------------------------------------------------
# combine_shuffling / split_shuffling: python loops over (rank, expert) chunks, row by row; the
# documented rules for counts that break the contract (negatives as 0; rows outside the tensor
# or the rank's padded block are not copied)


def oracle_shuffle_chunks(counts, start, end, num_rows, padded):
    """{(r, e): (rank-first row, expert-first row, rows copied)} for the local experts
    [start, end) of (EP, E) ``counts``, expert by expert and rank by rank inside an expert."""
    k = [[max(c, 0) for c in row] for row in counts.tolist()]
    num_ranks = len(k)
    block = num_rows // num_ranks if padded else None
    b, off = {}, 0
    for r in range(num_ranks):
        pre = 0
        for e, c in enumerate(k[r]):
            if padded:
                b[r, e] = (r * block + min(pre, block), max(0, min(c, block - pre)))
            else:
                b[r, e] = (off, c)
            pre += c
            off += c
    table, a = {}, 0
    for e in range(start, end):
        for r in range(num_ranks):
            table[r, e] = (b[r, e][0], a, b[r, e][1])
            a += k[r][e]
    return table


def oracle_shuffle(tokens, counts, start, end, padded, combine):
    """``combine_shuffling``'s tokens (``combine``; rank-first rows to expert-first) or
    ``split_shuffling``'s (back): each chunk's rows copied row by row (bit for bit: any dtype,
    integer bit views included), every other row zero."""
    num_rows = tokens.shape[0]
    out = torch.zeros_like(tokens)
    for b, a, n in oracle_shuffle_chunks(counts, start, end, num_rows, padded).values():
        src, dst = (b, a) if combine else (a, b)
        for j in range(min(n, num_rows)):  # rows past T are not copied
            if src + j < num_rows and dst + j < num_rows:
                out[dst + j] = tokens[src + j]
    return out


def oracle_shuffle_counts(counts, start, end):
    """``combine_shuffling``'s counts: per local expert the sum over ranks, then the total, in
    the counts' dtype."""
    per = [sum(counts[r, e].item() for r in range(counts.shape[0])) for e in range(start, end)]
    return torch.tensor([*per, sum(per)], dtype=torch.int64).to(counts.dtype)


def oracle_fbgemm_combine_shuffling(tokens, counts, start, end):
    """FBGEMM's test reference: slice rank-major over all columns, keep the local experts'
    chunks, concatenate them expert-major (only the rows it writes)."""
    chunks, offset = [[] for _ in range(counts.shape[1])], 0
    for per_rank in counts.tolist():
        for e, n in enumerate(per_rank):
            if start <= e < end:
                chunks[e].append(tokens[offset : offset + n])
            offset += n
    flat = [c for per_expert in chunks for c in per_expert]
    return torch.cat(flat) if flat else tokens[:0]


# ----------------------------------------------------------------------------------------------
# scatter_add_padded_tokens


def oracle_scatter_add_padded(in_tokens, counts, indices, out):
    """``scatter_add_padded_tokens`` on a copy of ``out`` (T, D), by the documented loop over
    in_tokens (EP, T_K, D): positions in ascending order, expert by cumulative counts (negatives
    as 0), rank = expert // (E // EP), one fp32 add rounded to out's dtype each (exact ints);
    positions past T_K and indices outside [0, T) are skipped."""
    out = out.clone()
    num_ranks, num_positions, _ = in_tokens.shape
    per_rank = counts.shape[0] // num_ranks
    p = 0
    for e, n in enumerate(counts.tolist()):
        for _ in range(min(max(n, 0), num_positions - p)):  # positions past T_K are skipped
            t = int(indices[p])
            if 0 <= t < out.shape[0]:
                row = in_tokens[e // per_rank, p]
                if out.dtype.is_floating_point:
                    out[t] = (out[t].float() + row.float()).to(out.dtype)
                else:
                    out[t] = out[t] + row.to(out.dtype)
            p += 1
    return out


def oracle_fbgemm_scatter_add_padded(in_tokens, counts, indices, out):
    """FBGEMM's test reference: rank r's positions [cumsum[r * E/EP], cumsum[(r+1) * E/EP]) of
    in_tokens[r], scatter-added at their indices (on a copy of ``out``)."""
    out = out.clone()
    num_ranks, _, dim = in_tokens.shape
    cum = [0, *torch.cumsum(counts, 0).tolist()]
    per_rank = counts.shape[0] // num_ranks
    idx = indices.long()
    for r in range(num_ranks):
        lo, hi = cum[per_rank * r], cum[per_rank * (r + 1)]
        if lo < hi:
            src = in_tokens[r, lo:hi]
            out.scatter_add_(0, idx[lo:hi, None].expand(-1, dim), src)
    return out
