"""Launcher of the fused attention kernel: `attention`, cpu_kernels.ops.attention on the GPU.

Legend: T new tokens, H query heads, KvH key/value heads, D head size, C cache capacity, R rotary
size, S positions from the block of the first one the first token sees to the last token.

The positions are split over programs (flash-decoding) so that a decode step, T KvH programs on
its own, still fills the GPU: about two programs per streaming multiprocessor, each split a whole
number of BLOCK_S positions. Position p is in slot p % C (a sliding window's ring, when the
context is longer than C).
"""

import math

import torch

from tierflow.cpu_kernels.hadamard import rotation_sizes
from tierflow.cpu_kernels.kv_layout import check_pass_fits, kv_type_of
from tierflow.gpu_kernels.launch import cdiv, check_device, check_tensor, load_kernels, num_sms, power_of_two

CACHE_DTYPES = (torch.float32, torch.float16, torch.uint8)  # of the cache types' rows


def attention(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, heads: int, start: int, neox: bool, num_splits: int | None = None,
              window: int = 0, scale: float | None = None, softcap: float = 0.0,
              held_from: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T new tokens in cache slots start .. start + T - 1 -> [T, H D] float32.

    qkv [T, (H + 2 KvH) D] (read only); one layer's keys [KvH, C/16, I, 16] and values [KvH, C, I]
    in any cache type (rows of I items: cpu_kernels/kv_layout.py), into which the tokens' rotated
    keys and their values are written in that type; cos, sin [T, R/2], the rows of the tokens'
    positions. Token i sees positions 0 .. start + i; query head h reads key/value head
    h // (H / KvH). float32 as the CPU kernel, which it matches to float32 rounding. num_splits
    fixes the number of position splits (by default, chosen to fill the GPU). Scores are scaled by
    scale (default D^-0.5), capped to softcap tanh(score / softcap) when softcap > 0, and with
    window > 0 token i sees positions start + i - window + 1 .. start + i only; none sees a
    position before held_from (the oldest the cache holds). Position p is in slot p % C: the
    window before the tokens and they must fit (kv_layout.check_pass_fits). A quantized cache holds
    its rows Hadamard-rotated as llama.cpp's (cpu_kernels/hadamard.py). sinks (float32 [H]) are
    attention sinks: one more logit per query head, whose probability goes to no value.
    """
    kernels = load_kernels("attention_kernels")
    kv_heads, capacity, head_dim, tokens, half = _check(qkv, keys, values, cos, sin, heads, start)
    kv = kv_type_of(keys, head_dim)
    if window < 0 or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"window must be >= 0 and softcap a finite number >= 0 (0: none), "
                         f"not {window} and {softcap}")
    check_pass_fits(capacity, start, tokens, start, window, held_from)
    if sinks is not None:
        check_tensor("sinks", sinks, (torch.float32,), (heads,))
    check_device(kernels, qkv=qkv, keys=keys, values=values, cos=cos, sin=sin, sinks=sinks)
    out = torch.empty(tokens, heads * head_dim, dtype=torch.float32, device=qkv.device)
    if tokens == 0:
        return out
    # the splits cover the blocks from the first position the first token sees
    base = max(start + 1 - window if window else 0, held_from) // kernels.BLOCK_S * kernels.BLOCK_S
    seen = start + tokens - base
    splits = num_splits or min(cdiv(seen, kernels.BLOCK_S), cdiv(2 * num_sms(qkv.device), tokens * kv_heads))
    split_size = cdiv(cdiv(seen, min(max(1, splits), kernels.MAX_SPLITS)), kernels.BLOCK_S) * kernels.BLOCK_S
    splits = cdiv(seen, split_size)
    partials = stats = out  # unused with one split
    if splits > 1:
        partials = torch.empty(tokens * heads * splits, head_dim, dtype=torch.float32, device=qkv.device)
        stats = torch.empty(tokens * heads * splits, 2, dtype=torch.float32, device=qkv.device)
    block_d = max(16, power_of_two(head_dim))
    scale = head_dim**-0.5 if scale is None else scale
    key_rotation, value_rotation = rotation_sizes(kv, head_dim)
    kernels.attention_kernel[(tokens, kv_heads, splits)](
        qkv, keys, values, cos, sin, out, partials, stats, start, heads, kv_heads, capacity,
        scale if softcap else scale * kernels.LOG2_E, base, split_size, splits, window or capacity, held_from,
        softcap, out if sinks is None else sinks,
        D=head_dim, HALF=half, GROUP=heads // kv_heads, NEOX=bool(neox), SPLIT=splits > 1,
        SOFTCAP=softcap > 0, BLOCK_G=max(16, power_of_two(heads // kv_heads)), BLOCK_S=kernels.BLOCK_S,
        BLOCK_D=block_d, KV=kernels.KV_CODES[kv.name], ROT_K=key_rotation, ROT_V=value_rotation,
        SINKS=sinks is not None)
    if splits > 1:
        kernels.merge_splits_kernel[(tokens * heads,)](partials, stats, out, splits, D=head_dim,
                                                       BLOCK_SPLITS=power_of_two(splits), BLOCK_D=block_d)
    return out


def _check(qkv, keys, values, cos, sin, heads: int, start: int) -> tuple[int, int, int, int, int]:
    """(KvH, C, D, T, R/2) once every argument agrees with the others."""
    check_tensor("values", values, CACHE_DTYPES, (None, None, None))
    kv_heads, capacity, items = values.shape
    if capacity % 16:
        raise ValueError(f"the cache capacity must be a multiple of 16, not {capacity}")
    check_tensor("keys", keys, (values.dtype,), (kv_heads, capacity // 16, items, 16))
    if kv_heads == 0 or heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads is not a multiple of the {kv_heads} key/value heads: {heads}")
    check_tensor("qkv", qkv, (torch.float32,), (None, None))
    head_dim = qkv.shape[1] // (heads + 2 * kv_heads)
    check_tensor("qkv", qkv, (torch.float32,), (None, (heads + 2 * kv_heads) * head_dim))
    kv_type_of(keys, head_dim)  # rows of a type, for this head size
    tokens = qkv.shape[0]
    check_tensor("cos", cos, (torch.float32,), (tokens, None))
    check_tensor("sin", sin, (torch.float32,), tuple(cos.shape))
    half = cos.shape[1]
    if not 0 < 2 * half <= head_dim:
        raise ValueError(f"cos and sin must be [{tokens}, R/2] with 2 <= R <= {head_dim}, "
                         f"not {list(cos.shape)}")
    if start < 0:
        raise ValueError(f"start must be >= 0, not {start}")
    return kv_heads, capacity, head_dim, tokens, half
