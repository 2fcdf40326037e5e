"""llama.cpp's rotation of a quantized KV cache, in torch (any device).

A quantized cache (q8_0, q4_0) whose head size is a multiple of 64 holds its rows multiplied by an
orthonormal Walsh-Hadamard matrix H, as llama.cpp's does (attn_rot_k, attn_rot_v; the environment
variable LLAMA_ATTN_ROT_DISABLE turns it off there): a block's scale then fits values whose
outlier features are spread over the block, instead of being set by one of them.

- Keys: the queries and the keys after rotary embedding, in blocks of K features, K the largest
  power of two dividing the head size. Scores are unchanged: (H q).(H k) = q.k.
- Values: in blocks of 64 features before they are stored, and each head's attention output in
  the same blocks afterwards, which undoes it (H is symmetric and its own inverse: the output is
  a weighted sum of the rotated values).
- Latent rows (multi-head latent attention, kv_types.CacheRows): the row [rotary key part R,
  latent L] and the queries as keys, in blocks of n, the largest power of two dividing both R and
  L, when n >= 64; the values are the rotated row's latent part, so each head's output in latent
  space is rotated back in the same blocks. No block straddles the two parts, so a context shift
  turns the rotary part's blocks alone and the latent's stay as stored. llama.cpp's cache takes n
  as the largest power of two dividing R + L (its rows are [latent, rotary part]): the same n
  wherever that n divides L, as in every DeepSeek-V2/V3 shape (R 64, L 512: n 64), and its
  sliding-window MLA graph rotates as here. Its deepseek2 graph (llama-cpp-python 0.3.36), though,
  stores the rows unrotated (the same logits with LLAMA_ATTN_ROT_DISABLE=1), and its context shift
  of a quantized MLA cache aborts ("not implemented" in ggml's dup).

`hadamard` is the one definition of the transform: butterfly stages (a + b, a - b), then times
float32 1/sqrt(n). The C kernel (csrc/ops.c) and the Triton kernel compute the same float32
operations in the same order, so the cache rows they write are the ones this module writes.

Legend: D head size, n the Hadamard size (a power of two dividing D).
"""

import torch

from tierflow.kv_types import CacheRows, KVType

VALUE_SIZE = 64  # llama.cpp rotates values in blocks of 64 whatever the head size


def rotation_sizes(kv: KVType, head_dim: int) -> tuple[int, int]:
    """(n of the queries and keys, n of the values) of a cache in the type: 0 where it holds
    plain rows (a float type, or a head size that is not a multiple of 64)."""
    if kv.block_values == 1 or head_dim % 64:
        return 0, 0
    return head_dim & -head_dim, VALUE_SIZE


def cache_rotation_sizes(kv: KVType, rows: CacheRows) -> tuple[int, int]:
    """rotation_sizes of a layer's cache of these rows (latent rows: the keys' only, see above)."""
    if not rows.latent:
        return rotation_sizes(kv, rows.key_dim)
    both = rows.rotary_dim | (rows.key_dim - rows.rotary_dim)
    size = both & -both  # the largest power of two dividing both parts
    return (size if kv.block_values > 1 and size >= 64 else 0), 0


def hadamard(x: torch.Tensor, size: int) -> torch.Tensor:
    """x [..., D] with each block of `size` features multiplied by H (size 0: x itself), float32."""
    if not size:
        return x
    blocks = x.float().unflatten(-1, (-1, size))  # [..., D/n, n]
    half = 1
    while half < size:  # feature j meets feature j + half in each run of 2 * half
        pairs = blocks.unflatten(-1, (size // (2 * half), 2, half))
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        blocks = torch.stack((first + second, first - second), dim=-2).flatten(-3)
        half *= 2
    return (blocks * scale_of(size)).flatten(-2)


def scale_of(size: int) -> float:
    """n^-1/2 rounded to float32, the factor every kernel multiplies by after the butterflies."""
    return float(torch.tensor(size**-0.5, dtype=torch.float32))
