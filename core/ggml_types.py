"""Tensor types: ggml's own, plus two tierflow adds for 2- and 3-bit weights.

Standard GGUF has no 2- or 3-bit type with 32-weight blocks (its K-quants need rows that are a
multiple of 256, which SmolLM2's 576 is not), so `tierflow convert --bits 2|3` writes these.
Both are Q4_1 with fewer bits per code: each block of 32 consecutive weights of a row stores a
float16 scale d and a float16 offset m, and weight j of the block is `d * q[j] + m` (in float32,
the product first, as for Q4_1). All fields are little-endian.

| type  | id   | block bytes | bits per weight | layout (byte offsets)                      |
| ----- | ---- | ----------- | --------------- | ------------------------------------------ |
| Q4_1  | 3    | 20          | 5.0             | d f16 @0, m f16 @2, qs[16] @4 (ggml's)     |
| TQ3_1 | 1003 | 16          | 4.0             | d f16 @0, m f16 @2, qh[4] @4, qs[8] @8     |
| TQ2_1 | 1002 | 12          | 3.0             | d f16 @0, m f16 @2, qs[8] @4               |

- Q4_1 (for comparison): q[j] (0..15) is the low nibble of qs[j] for j < 16, else the high
  nibble of qs[j - 16].
- TQ2_1: q[j] (0..3) is bits 2*(j%4) and 2*(j%4)+1 of qs[j // 4].
- TQ3_1: q[j] (0..7) = low + 4 * high, where low is bits 2*(j%4)..2*(j%4)+1 of qs[j // 4] (as in
  TQ2_1) and high is bit j%8 of qh[j // 8].

The ids sit far above ggml's (below 100 today), out of the way of future ggml types. llama.cpp
cannot load files that use them; tierflow reads them like any other type.
"""

from collections.abc import Mapping
from enum import IntEnum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


class TierflowType(IntEnum):
    """tierflow's own tensor types; ids above ggml's range."""

    TQ2_1 = 1002
    TQ3_1 = 1003


TIERFLOW_QUANT_SIZES: Mapping[int, tuple[int, int]] = {  # type -> (weights, bytes) per block
    TierflowType.TQ2_1: (32, 12),
    TierflowType.TQ3_1: (32, 16),
}

# Every type a GGUF file read by tierflow may hold: (weights per block, bytes per block).
QUANT_SIZES: Mapping[int, tuple[int, int]] = {**GGML_QUANT_SIZES, **TIERFLOW_QUANT_SIZES}


def type_name(ggml_type: int) -> str:
    """'Q4_1', 'TQ2_1', ...; the number itself for an unknown type."""
    for enum in (GGMLQuantizationType, TierflowType):
        try:
            return enum(ggml_type).name
        except ValueError:
            pass
    return str(int(ggml_type))
