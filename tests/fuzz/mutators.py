"""Random mutations of a seed, one family per function: each draws a fully stated mutation from
`rng`, so the same rng state always gives the same edit."""

from __future__ import annotations

import random

import numpy as np

from tests.fuzz import mutations as m
from tests.fuzz.seeds import Seed
from tests.fuzz.values import (
    ARCHITECTURE_NAMES,
    BOUNDARY_INTS,
    TEMPLATES,
    boundary_int,
    hostile_value,
    plausible_value,
    wrong_type,
)
from tests.support.gguf_bytes import STRING, UINT32, Typed
from tierflow.ggml_types import QUANT_SIZES

# Keys a family may read that the seeds do not all carry ({arch} is the seed's architecture).
OPTIONAL_KEYS = ("{arch}.attention.key_length", "{arch}.attention.value_length", "{arch}.expert_count",
                 "{arch}.expert_used_count", "{arch}.expert_feed_forward_length",
                 "{arch}.expert_shared_feed_forward_length", "{arch}.rope.scaling.type",
                 "{arch}.rope.scaling.factor", "{arch}.rope.scaling.original_context_length",
                 "{arch}.rope.scale_linear", "{arch}.attention.head_count_kv", "general.alignment",
                 "general.name", "tokenizer.ggml.pre", "tokenizer.ggml.add_eos_token",
                 "tokenizer.ggml.sep_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.chat_template")
VOCABULARY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                     "tokenizer.ggml.scores")
TOKENIZER_MODELS = ("llama", "gpt2", "bert", "t5", "rwkv", "plamo2", "no_vocab", "none", "", "GPT2")
PRE_TOKENIZERS = ("whitespace", "default", "llama3", "gpt-2", "smollm", "qwen2", "no-such-pre", "")
# ggml types: supported ones, ones tierflow cannot compute, tierflow's own, and unknown ids.
TENSOR_TYPES = (0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 16, 24, 26, 28, 30, 4, 5, 39, 40, 1002, 1003, 2**31)
HALF_BITS = (0x7C00, 0xFC00, 0x7E00, 0x8000, 0x7BFF, 0x0001, 0x0000)


def _position(rng: random.Random, seed: Seed) -> int:
    """A byte offset, most often in the header, the early metadata or the tensor table."""
    region = rng.randrange(3)
    if region == 0:
        return rng.randrange(1024)
    if region == 1:
        return rng.randrange(*seed.tensor_table)
    return rng.randrange(len(seed.data))


def metadata_value(rng: random.Random, seed: Seed) -> m.SetValue:
    keys = [key for key in seed.metadata if key not in VOCABULARY_ARRAYS]
    keys += [key.format(arch=seed.arch) for key in OPTIONAL_KEYS]
    key = rng.choice(keys)
    current = seed.metadata.get(key)
    value = plausible_value(rng, current) if rng.random() < 0.4 else hostile_value(rng, current)
    return m.SetValue(key, value)


def metadata_key(rng: random.Random, seed: Seed) -> m.DeleteKey | m.DuplicateKey:
    key = rng.choice(list(seed.metadata))
    return m.DeleteKey(key) if rng.random() < 0.75 else m.DuplicateKey(key)


def architecture(rng: random.Random, seed: Seed) -> m.SetArchitecture:
    return m.SetArchitecture(rng.choice(ARCHITECTURE_NAMES), rename_keys=rng.random() < 0.7)


def header(rng: random.Random, seed: Seed) -> m.SetVersion | m.SetAlignment:
    if rng.random() < 0.3:
        return m.SetVersion(rng.choice((0, 1, 2, 4, 0x03000000)))
    return m.SetAlignment(rng.choice((1, 2, 4, 8, 16, 64, 4096)))


def _shape(rng: random.Random, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Another shape: a dimension changed, added or removed, or boundary values throughout."""
    choice = rng.randrange(4)
    if choice == 0 and shape:
        index = rng.randrange(len(shape))
        return shape[:index] + (rng.choice([1, 32, shape[index] * 2, shape[index] // 2, 0, -1]),) \
            + shape[index + 1:]
    if choice == 1:
        return shape + (rng.choice((1, 2, 4)),) * rng.randrange(1, 4)
    if choice == 2:
        return shape[:rng.randrange(len(shape))]
    dimensions = [n for n in BOUNDARY_INTS + (64, 128) if -2**63 <= n < 2**63]  # GGUF's are int64
    return tuple(rng.choice(dimensions) for _ in range(rng.randrange(1, 5)))


def tensor(rng: random.Random, seed: Seed):
    spec = rng.choice(seed.parts.tensors)
    others = [other.name for other in seed.parts.tensors if other.name != spec.name]
    kind = rng.randrange(6)
    if kind == 0:
        return m.SetShape(spec.name, _shape(rng, spec.shape), fit_data=rng.random() < 0.7)
    if kind == 1:
        return m.SetType(spec.name, rng.choice(TENSOR_TYPES), fit_data=rng.random() < 0.7)
    if kind == 2:
        offset = rng.choice((1, 16, 32, 2**32, 2**63, 2**64 - 32, len(seed.data)))
        return m.SetOffset(spec.name, offset)
    if kind == 3:
        layer = rng.choice(("blk.99.", "blk.-1.", "blk.2.", "blk.0.", "blk.1000000000."))
        suffix = spec.name.split(".", 2)[-1]
        return m.RenameTensor(spec.name, rng.choice((rng.choice(others), layer + suffix, "", "x" * 64,
                                                     b"blk.0.\xff\xfe.weight", spec.name.upper())))
    return (m.DropTensor if kind == 4 else m.DuplicateTensor)(spec.name)


def vocabulary(rng: random.Random, seed: Seed):
    present = [key for key in VOCABULARY_ARRAYS if key in seed.metadata]
    key = rng.choice(present)
    size = len(seed.metadata[key])
    kind = rng.randrange(8)
    if kind == 0:
        return m.CopyArrayItem(key, rng.randrange(size), rng.randrange(size))
    if kind == 1:
        return m.ResizeArray(key, rng.choice((0, 1, size - 1, size + 1, size // 2, size + 300)))
    if kind == 2 and isinstance(seed.metadata[key], list):
        return m.FlipItemBit(key, rng.randrange(size), rng.randrange(64))
    if kind in (2, 3):
        return m.SetArrayItem(key, rng.randrange(size), _item(rng, seed.metadata[key]))
    if kind == 4:
        return m.SetValue("tokenizer.ggml.model", Typed(STRING, rng.choice(TOKENIZER_MODELS)))
    if kind == 5:
        return m.SetValue("tokenizer.ggml.pre", Typed(STRING, rng.choice(PRE_TOKENIZERS)))
    if kind == 6:
        return _special_token_id(rng, seed)
    return m.SetValue(key, wrong_type(rng))


def _special_token_id(rng: random.Random, seed: Seed) -> m.SetValue:
    """bos, eos, ... set to another token, or to a boundary integer near the vocabulary's size."""
    keys = [key for key in seed.metadata if key.endswith("_token_id")] + ["tokenizer.ggml.sep_token_id"]
    num_tokens = len(seed.metadata["tokenizer.ggml.tokens"])
    if rng.random() < 0.5:
        return m.SetValue(rng.choice(keys), Typed(UINT32, rng.randrange(num_tokens)))
    return m.SetValue(rng.choice(keys), boundary_int(rng, num_tokens))


def _item(rng: random.Random, items) -> object:
    """A replacement array item of the array's own type."""
    if isinstance(items, list):
        return rng.choice(("", "\0", "a b", "<0xZZ>", "<|im_end|>", " ", "Ġ", "x" * 10_000, "\ufffd"))
    if items.dtype == np.int32:
        return rng.choice((-1, 0, 6, 7, 255, 2**31 - 1, -2**31))
    return rng.choice((np.nan, np.inf, -np.inf, -1e38))


def chat_template(rng: random.Random, seed: Seed) -> m.SetValue:
    return m.SetValue("tokenizer.chat_template", Typed(STRING, rng.choice(TEMPLATES)))


def weights(rng: random.Random, seed: Seed):
    spec = rng.choice(seed.parts.tensors)
    if spec.ggml_type == 0:  # F32
        element = rng.randrange(len(spec.data) // 4)
        return m.SetElement(spec.name, element, rng.choice((float("nan"), float("inf"), -float("inf"), 3e38)))
    num_blocks = len(spec.data) // QUANT_SIZES[spec.ggml_type][1]
    return m.SetBlockScale(spec.name, rng.randrange(num_blocks), rng.choice(HALF_BITS))


def byte_edit(rng: random.Random, seed: Seed, seeds: dict[str, Seed]):
    """One edit of the written file's bytes: positions are the seed's, which a structured edit
    before it may have moved."""
    position, kind = _position(rng, seed), rng.randrange(6)
    if kind == 0:
        return m.FlipBit(position, rng.randrange(8))
    if kind == 1:
        return m.WriteInt(position, rng.choice(BOUNDARY_INTS), rng.choice((4, 8)))
    if kind == 2:
        return m.InsertBytes(position, rng.randbytes(rng.choice((1, 4, 8, 100))))
    if kind == 3:
        return m.DeleteBytes(position, rng.choice((1, 4, 8, 100)))
    if kind == 4:
        return m.Truncate(position)
    other = rng.choice(sorted(seeds))
    return m.Splice(position, other, _position(rng, seeds[other]))


STRUCTURED_FAMILIES = {  # family -> (weight, mutator)
    "metadata value": (25, metadata_value),
    "metadata key": (8, metadata_key),
    "architecture": (7, architecture),
    "header": (4, header),
    "tensor table": (20, tensor),
    "vocabulary": (15, vocabulary),
    "chat template": (10, chat_template),
    "weights": (5, weights),
}
BYTE_WEIGHT = 15  # against the structured families' 90
