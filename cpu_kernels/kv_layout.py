"""The KV cache's layout per type, and its rows encoded and decoded in torch (any device).

A position's key (or value) of one head is a row of R items, the type's own encoding of the D
features: D float32 (f32), D float16 (f16), or the D/32 blocks' bytes of llama.cpp's q8_0 or
q4_0 (R = row_bytes, see tierflow.kv_types), bit for bit what llama.cpp would store. A quantized
type's rows are those of the Hadamard-rotated keys and values where llama.cpp rotates them
(hadamard.py): `encode` and `decode` see the rows as stored, the caller rotates.

A layer's values are [K, C, R]: a row per head and position. Its keys are [K, C/16, R, 16]: the
rows of 16 positions stored transposed, item r of the 16 positions side by side, so that the C
and Triton kernels score 16 positions with vertical multiply-adds over one contiguous block (for
the quantized types: the 16 scales' low bytes, their high bytes, then each code byte of the 16
positions). Position p's key row is keys[:, p // 16, :, p % 16] for every type.

The quantizers follow llama.cpp's reference ones (quantize_row_q8_0_ref, quantize_row_q4_0_ref)
step by step in float32, roundings included, so that the C kernels (csrc/ops.c), which quantize
the same way, and gguf-py write the same bytes. Dequantized, every value is exact in float32
(d * q: an 11-bit scale times a small integer).

Legend: K key/value heads, C cache capacity (a multiple of 16), D head size, R items per row,
B = D/32 blocks.
"""

import numpy as np
import torch

from tierflow.kv_types import KV_TYPES, KVType, scored_slots

BLOCK = 32  # values per block of the quantized types
CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "q8_0": torch.uint8, "q4_0": torch.uint8}


def row_items(kv: KVType, head_dim: int) -> int:
    """R: items of one head's row (floats, halves or bytes)."""
    return head_dim if kv.block_values == 1 else kv.row_bytes(head_dim)


def cache_shapes(kv: KVType, kv_heads: int, capacity: int, head_dim: int) -> tuple[tuple[int, ...], ...]:
    """(keys' shape, values' shape) of one layer; capacity a multiple of 16."""
    items = row_items(kv, head_dim)
    return (kv_heads, capacity // 16, items, 16), (kv_heads, capacity, items)


def kv_type_of(keys: np.ndarray | torch.Tensor, head_dim: int) -> KVType:
    """The type a layer's cache holds, from its keys' dtype and row width."""
    dtype, items = str(keys.dtype).removeprefix("torch."), keys.shape[2]
    if dtype in ("float32", "float16") and items == head_dim:
        return KV_TYPES["f32" if dtype == "float32" else "f16"]
    for kv in (KV_TYPES["q8_0"], KV_TYPES["q4_0"]):
        if dtype == "uint8" and head_dim % BLOCK == 0 and items == kv.row_bytes(head_dim):
            return kv
    raise ValueError(f"a KV cache of {dtype} rows of {items} items is no cache type's "
                     f"for head size {head_dim}")


def check_pass_fits(capacity: int, start: int, tokens: int, tree_start: int, window: int,
                    held_from: int) -> None:
    """Raises ValueError, as the kernels do, for a pass that does not fit in a cache of `capacity`
    positions (kv_types.scored_slots: a ring must hold the window before it and its tokens) or a
    held_from after its first token."""
    if scored_slots(tree_start, start + tokens, window) > capacity:
        raise ValueError(f"attention: positions {tree_start} .. {start + tokens - 1} with a window of "
                         f"{window} do not fit in the cache of {capacity} positions")
    if not 0 <= held_from <= tree_start:
        raise ValueError(f"attention: held_from must be from 0 to {tree_start}, not {held_from}")


def encode(x: torch.Tensor, kv: KVType) -> torch.Tensor:
    """Rows [..., D] float32 -> [..., R] in the type (llama.cpp's block bytes when quantized)."""
    if kv.name in ("f32", "f16"):
        return x.to(CACHE_DTYPES[kv.name])
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # [..., B, 32]
    scale, codes = (_quantize_q8_0 if kv.name == "q8_0" else _quantize_q4_0)(blocks)
    scale_bytes = scale.to(torch.float16).view(torch.uint8)  # [..., B, 2], little-endian
    return torch.cat([scale_bytes, codes], dim=-1).flatten(-2)


def decode(rows: torch.Tensor, kv: KVType) -> torch.Tensor:
    """Rows [..., R] in the type -> [..., D] float32 (exact)."""
    if kv.name in ("f32", "f16"):
        return rows.float()
    blocks = rows.unflatten(-1, (-1, kv.block_bytes))  # [..., B, bytes]
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., B, 1]
    packed = blocks[..., 2:]
    if kv.name == "q8_0":
        codes = packed.view(torch.int8).float()
    else:  # q[j] in the low nibble of byte j, q[j + 16] in its high nibble
        codes = torch.cat([packed & 15, packed >> 4], dim=-1).float() - 8
    return (codes * scale).flatten(-2)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly: v + 0.5 would round before the floor."""
    a = v.abs()
    whole = a.floor()
    return torch.copysign(whole + (2 * (a - whole)).floor(), v)


def _quantize_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d float32 [..., B, 1], codes as bytes [..., B, 32]): d = max|x| / 127, q = roundf(x / d)."""
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, 0.0, 1 / d)
    return d, _roundf(blocks * inverse).to(torch.int8).view(torch.uint8)


def _quantize_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d float32 [..., B, 1], packed nibbles [..., B, 16]): d = -m / 8 for m the value of largest
    magnitude (the first such), q = min(15, trunc(x / d + 8.5))."""
    m = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = m / -8
    inverse = torch.where(d == 0, 0.0, 1 / d)
    q = (blocks * inverse + 8.5).trunc().clamp(max=15).to(torch.uint8)
    return d, q[..., :16] | (q[..., 16:] << 4)


def read_rows(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The stored rows (key [K, n, R], value [K, n, R]) at int64 positions."""
    return keys[:, positions // 16, :, positions % 16].transpose(0, 1), values[:, positions]


def write_rows(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, key_rows: torch.Tensor,
               value_rows: torch.Tensor) -> None:
    """Stores rows [K, n, R] at int64 positions."""
    keys[:, positions // 16, :, positions % 16] = key_rows.transpose(0, 1)
    values[:, positions] = value_rows
