"""The MXFP8 special-value table: blocks of 32 whose scale and data bytes were worked out by hand
from the rules in ``moe_kernels.mxfp8``'s docstring (torchao's rules after 0.18), no code computing
them: zero and signed-zero blocks, inf / NaN blocks, subnormals of every input dtype, the formats'
maxima and the rceil / floor boundaries. ``special_table`` makes one dtype's and mode's cases
(numpy needed); ``tests/gpu/test_mxfp8_gpu.py`` checks the GPU against it."""

from __future__ import annotations

import math
import struct

import torch

__all__ = ["SPECIAL_CASES", "special_table"]

# Each row: (name, input dtypes (F fp32, B bf16, H fp16), the first values of a block of 32, the
# value filling the rest, expected (scale byte, data bytes of the first values, data byte of the
# fill) for "floor", the same for "rceil"). The bytes are worked out by hand from the rules in
# moe_kernels.mxfp8's docstring (torchao's rules after 0.18): no code computes them.


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


INF, NAN = math.inf, math.nan
F32_MAX = _f32(0x7F7FFFFF)  # (2 - 2**-23) * 2**127
BF16_MAX = _f32(0x7F7F0000)  # (2 - 2**-7) * 2**127
P35 = _f32(0x40600001)  # 3.5 + 1 ulp: bf16 and fp16 round it to 3.5
P512 = _f32(0x43FFFFFF)  # 512 - 1 ulp: bf16 and fp16 round it to 512
INVALID = (255, [], 0x7F)  # a block with an inf or a NaN: NaN scale, all data NaN
# fmt: off
SPECIAL_CASES = [
    ("zero block", "FBH", [], 0.0, (0, [], 0x00), (0, [], 0x00)),
    ("-0 block keeps the sign", "FBH", [], -0.0, (0, [], 0x80), (0, [], 0x80)),
    ("+inf among ones", "FBH", [1.0, INF], 1.0, INVALID, INVALID),
    ("-inf among zeros", "FBH", [-INF], 0.0, INVALID, INVALID),
    ("+inf and -inf beside 448", "FBH", [INF, -INF], 448.0, INVALID, INVALID),
    ("NaN among ones", "FBH", [NAN], 1.0, INVALID, INVALID),
    ("negative NaN", "FBH", [-NAN], 0.0, INVALID, INVALID),
    ("inf and NaN", "FBH", [2.0, INF, NAN], 0.0, INVALID, INVALID),
    # scale 2**-127 (byte 0): data x * 2**127
    ("2**-126 block", "FB", [2**-126, -(2**-126)], 2**-126, (0, [0x40, 0xC0], 0x40),
     (0, [0x40, 0xC0], 0x40)),
    ("2**-133, bf16's smallest subnormal", "FB", [2**-133, -(2**-133)], 0.0,
     (0, [0x08, 0x88], 0x00), (0, [0x08, 0x88], 0x00)),
    ("2**-149, fp32's smallest subnormal", "F", [2**-149, -(2**-149)], 0.0,
     (0, [0x00, 0x80], 0x00), (0, [0x00, 0x80], 0x00)),
    ("448, e4m3's max", "FBH", [448.0, -448.0], 0.0, (127, [0x7E, 0xFE], 0),
     (127, [0x7E, 0xFE], 0)),
    # floor: 2**(127 - 8), x / 2**119 ~ 512 saturates to 448; rceil: 2**120, x / 2**120 ~ 256
    ("fp32 max", "F", [F32_MAX, -F32_MAX], 0.0, (246, [0x7E, 0xFE], 0), (247, [0x78, 0xF8], 0)),
    ("bf16 max", "FB", [BF16_MAX, -BF16_MAX], 0.0, (246, [0x7E, 0xFE], 0),
     (247, [0x78, 0xF8], 0)),
    ("480", "FBH", [480.0, -480.0], 0.0, (127, [0x7E, 0xFE], 0), (128, [0x77, 0xF7], 0)),
    # amax 1.0: scale 2**-8 in both modes; the subnormal * 2**8 rounds to (signed) zero
    ("ones and fp32's smallest subnormal", "F", [2**-149, -(2**-149)], 1.0,
     (119, [0x00, 0x80], 0x78), (119, [0x00, 0x80], 0x78)),
    ("ones and bf16's smallest subnormal", "FB", [2**-133, -(2**-133)], 1.0,
     (119, [0x00, 0x80], 0x78), (119, [0x00, 0x80], 0x78)),
    ("ones and fp16's smallest subnormal", "FBH", [2**-24, -(2**-24)], 1.0,
     (119, [0x00, 0x80], 0x78), (119, [0x00, 0x80], 0x78)),
    # fp32 3.5 + ulp: floor 2**-7 (448.00003 saturates); rceil needs 2**-6 (224.00002 -> 224)
    ("0x40600001", "F", [P35], 0.0, (120, [0x7E], 0), (121, [0x76], 0)),
    ("0x40600001 rounded to 3.5", "BH", [P35], 0.0, (120, [0x7E], 0), (120, [0x7E], 0)),
    # fp32 512 - ulp: floor 2**0 (511.99997 saturates); rceil 2**1 (255.99998 -> 256)
    ("0x43FFFFFF", "F", [P512], 0.0, (127, [0x7E], 0), (128, [0x78], 0)),
    ("0x43FFFFFF rounded to 512", "BH", [P512], 0.0, (128, [0x78], 0), (128, [0x78], 0)),
    # fp16 (worked out by hand): its subnormals and max are ordinary fp32 normals, so they get
    # ordinary scales, unlike the fp32/bf16 subnormals above. 65504 = 1.999 * 2**15: floor
    # 2**(15 - 8) (byte 134), 65504 / 128 = 511.75 saturates to 448; rceil 2**8 (byte 135),
    # 65504 / 256 = 255.875 rounds to 256 (0x78). (bf16 rounds 65504 to 65536: not in "B".)
    ("65504, fp16's max", "FH", [65504.0, -65504.0], 0.0, (134, [0x7E, 0xFE], 0),
     (135, [0x78, 0xF8], 0)),
    # 2**-24 alone: floor and rceil both 2**(-24 - 8) (byte 95), data 2**8 = 256 (0x78)
    ("2**-24, fp16's smallest subnormal", "FBH", [2**-24, -(2**-24)], 0.0,
     (95, [0x78, 0xF8], 0), (95, [0x78, 0xF8], 0)),
    # 2**-14: both 2**-22 (byte 105), data 256
    ("2**-14, fp16's smallest normal", "FBH", [2**-14], 0.0, (105, [0x78], 0), (105, [0x78], 0)),
    # 1023 * 2**-24 = 1.998 * 2**-15: floor 2**-23 (byte 104), 511.5 saturates to 448; rceil
    # 2**-22 (byte 105), 255.75 rounds to 256. (bf16 rounds it to 2**-14: not in "B".)
    ("1023 * 2**-24, fp16's largest subnormal", "FH", [1023 * 2**-24], 0.0, (104, [0x7E], 0),
     (105, [0x78], 0)),
]
# fmt: on
_DTYPE_LETTER = {torch.float32: "F", torch.bfloat16: "B", torch.float16: "H"}


def special_table(dtype: torch.dtype, mode: str):
    """(names, x (N, 32) of ``dtype``: one case a row, scale (N,) uint8, data (N, 32) uint8) of
    the cases of ``SPECIAL_CASES`` for ``dtype`` in ``mode`` ("floor" or "rceil")."""
    import numpy as np

    names, rows, scales, datas = [], [], [], []
    for name, dtypes, head, fill, floor, rceil in SPECIAL_CASES:
        if _DTYPE_LETTER[dtype] not in dtypes:
            continue
        scale, head_bytes, fill_byte = floor if mode == "floor" else rceil
        names.append(name)
        rows.append([*head, *[fill] * (32 - len(head))])
        scales.append(scale)
        datas.append([*head_bytes, *[fill_byte] * (32 - len(head_bytes))])
    # every value is an exact fp32; build the fp32 bits first (keeps NaN signs), then round once
    f32 = np.array(rows, dtype=np.float32)
    x = torch.from_numpy(f32).to(dtype)
    return names, x, np.array(scales, np.uint8), np.array(datas, np.uint8)
