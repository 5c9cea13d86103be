"""Host-side block arithmetic shared by the launchers, in plain Python.

Triton >= 3.8 makes ``triton.cdiv`` and ``triton.next_power_of_2`` constexpr functions, which cost
about 5 us a call from host code (CI's CPU, Triton 3.8 and 3.9; 0.01 us for the plain
expression): several per launch were more than the rest of a small op's host time.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_clamp(value: int, lo: int, hi: int) -> int:
    """The smallest power of two >= value (1 for value <= 1), clamped into [lo, hi]: a block
    size for a dimension of ``value``."""
    return max(lo, min(hi, next_pow2(max(value, 1))))
