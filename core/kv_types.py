"""The types a KV cache stores keys and values in: llama.cpp's, with its block formats, so that
`--kv-type q8_0` means here what `-ctk q8_0 -ctv q8_0` means there.

| type | ggml id | values per block | block bytes | layout of a block (little-endian)     |
| ---- | ------- | ---------------- | ----------- | ------------------------------------- |
| f32  | 0       | 1                | 4           | the value                             |
| f16  | 1       | 1                | 2           | the value, IEEE half                  |
| q8_0 | 8       | 32               | 34          | d f16, q int8[32]: value j = d * q[j] |
| q4_0 | 2       | 32               | 18          | d f16, qs[16]: value j = d * (q[j] - 8)   |

In q4_0, q[j] is the low nibble of qs[j] for j < 16, else the high nibble of qs[j - 16].

A block runs along one head's features, so the quantized types need a head size that is a
multiple of 32. What a layer caches per position is its `CacheRows`: a key and a value row per KV
head, or for multi-head latent attention (deepseek2) one row holding the rotary part of the key
and the compressed latent, which all heads share and which serves as their values too (in a
quantized type each part is whole blocks, as llama.cpp's view of the latent needs). The planner,
the cache and the benchmarks all size a cache through `CacheRows.position_bytes` and
`cache_positions`.
"""

from dataclasses import dataclass

from tierflow.errors import InvalidArgumentError


@dataclass(frozen=True)
class KVType:
    name: str
    ggml_id: int  # llama.cpp's type_k / type_v for the same format
    block_values: int
    block_bytes: int

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one head's key (or value) at one position."""
        return head_dim // self.block_values * self.block_bytes

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.block_values:
            raise InvalidArgumentError(f"the KV cache type {self.name} stores blocks of {self.block_values} "
                                       f"values along a head, but this model's head size is {head_dim}; "
                                       f"use f16 or f32")


@dataclass(frozen=True)
class CacheRows:
    """What one layer caches per position: `heads` key rows of key_dim features and value rows of
    value_dim (0: none, the values being a view of the key rows: the latent cache)."""

    heads: int
    key_dim: int
    value_dim: int
    latent: bool = False  # one row of [rotary key part, latent], read as keys and as values
    rotary_dim: int = 0  # latent rows: the width of the rotary key part leading each row

    def position_bytes(self, kv: KVType) -> int:
        """Bytes one position takes in one layer's cache stored as `kv`."""
        return self.heads * (kv.row_bytes(self.key_dim) + kv.row_bytes(self.value_dim))

    def check(self, kv: KVType) -> None:
        """Refuses a cache type these rows cannot be stored in."""
        if not self.latent:
            for dim in (self.key_dim, self.value_dim):
                kv.check_head_dim(dim)
        elif self.rotary_dim % kv.block_values or self.key_dim % kv.block_values:
            raise InvalidArgumentError(
                f"the KV cache type {kv.name} stores blocks of {kv.block_values} values, but this model's "
                f"latent cache rows hold a rotary part of {self.rotary_dim} and a latent of "
                f"{self.key_dim - self.rotary_dim} values, which must each be a multiple of "
                f"{kv.block_values}; use f16 or f32")


KV_TYPES = {kv.name: kv for kv in (KVType("f32", 0, 1, 4), KVType("f16", 1, 1, 2),
                                     KVType("q8_0", 8, 32, 34), KVType("q4_0", 2, 32, 18))}
DEFAULT_KV_TYPE = "f16"
MAX_PASS_TOKENS = 512  # the most positions one forward pass writes: a prefill chunk (PREFILL_CHUNK)


def kv_type(name: str | None) -> KVType:
    """The KV cache type named (None: the default); an unknown name is refused naming the valid ones."""
    if name is None:
        return KV_TYPES[DEFAULT_KV_TYPE]
    if not isinstance(name, str) or name.lower() not in KV_TYPES:
        raise InvalidArgumentError(f"unknown KV cache type {name!r}: choose one of {', '.join(KV_TYPES)}")
    return KV_TYPES[name.lower()]


def cache_positions(context_length: int, window: int) -> int:
    """Positions one layer's cache holds, a multiple of 16 (a block of keys): the whole context, or
    for a sliding-window layer (window W > 0) whose context is longer, a ring (`ring_positions`)."""
    whole = -(-context_length // 16) * 16
    return min(whole, ring_positions(window)) if window else whole


def ring_positions(window: int) -> int:
    """The ring of a layer with window W: position p lives in slot p % ring.

    A pass of T <= MAX_PASS_TOKENS tokens at positions s .. s + T - 1 scores whole blocks of 16
    slots, from the block holding the first position its first token sees, s + 1 - W, to s + T
    rounded up to 16: at most ceil16(W + T - 1 + 15) slots when s + 1 - W sits at the end of its
    block. A ring of ceil16(W + MAX_PASS_TOKENS + 14) slots (W + MAX_PASS_TOKENS and a slack of 14
    to 29) therefore never holds two of one pass's positions in one slot. It also means a pass
    never overwrites what the window before it needs: its writes evict positions below
    s + T - ring < s + 1 - W, so a failed or cancelled pass can be rewound to s.
    """
    return -(-(window + MAX_PASS_TOKENS + 14) // 16) * 16


def scored_slots(start: int, end: int, window: int) -> int:
    """Slots a pass scores whose tokens sit at positions start .. end - 1 (a token tree: start is
    its first slot, end its last slot + 1): from the block of the first position its first
    token sees to end rounded up to 16. A cache of C positions takes the pass if this is <= C."""
    first = max(start + 1 - window, 0) if window else 0
    return -(-end // 16) * 16 - first // 16 * 16
