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
multiple of 32. The planner, the cache and the benchmarks all size a cache through `row_bytes`
and `cache_positions`.
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
    """Positions one layer's cache holds, rounded up to 16 (a block of keys): the whole context.
    A sliding-window layer (window > 0) is masked to its window but still stores every position:
    a ring of the window plus the most one pass writes (MAX_PASS_TOKENS) is not built yet, and the
    budgets count what the cache holds."""
    return -(-context_length // 16) * 16
