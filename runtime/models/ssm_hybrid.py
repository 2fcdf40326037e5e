"""What the hybrids of Mamba and attention layers share (granitehybrid.py, nemotron_h.py, jamba.py): a
layer pattern read from per-layer metadata arrays, the config of a transformer whose recurrent layers
are Mamba-2's (mamba2.py) or Mamba-1's (mamba.py, Jamba's), and each layer's kind of memory.

llama.cpp tells a layer's kind by per-layer counts: `attention.head_count_kv` (0: no attention) and,
for some families, `feed_forward_length` (0: no FFN); a single count stands for every layer. A family
turns each layer's counts into one of its layer types:

    "recurrent"  a Mamba mixer (mamba2.mixer; Jamba's mamba.mixer) over a recurrent state
                 (kinds.RecurrentState)
    "attention"  causal self-attention over the whole context (kinds.FullCache)
    "ffn"        an FFN alone, which keeps nothing between passes (kinds.NoMemory)
"""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.memory.kinds import FullCache, LayerMemory, NoMemory, RecurrentState
from tierflow.runtime.memory.state_shapes import ScanShape
from tierflow.runtime.models import mamba2
from tierflow.runtime.models.architecture import transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig


def per_layer(meta: Metadata, key: str, num_layers: int) -> tuple[int, ...]:
    """{arch}.{key} for each layer: an array of one count >= 0 per layer, or one count for all."""
    name, value = f"{meta.arch}.{key}", meta.metadata.get(f"{meta.arch}.{key}")
    if not isinstance(value, (list, tuple, np.ndarray)):
        return (meta.count(key, minimum=0),) * num_layers
    counts = list(value)
    if len(counts) != num_layers or not all(_is_count(c) for c in counts):
        raise ModelFileError(f"metadata '{name}' must be one count >= 0 per layer ({num_layers}), "
                             f"got an array of {len(counts)}: {counts[:8]}")
    return tuple(int(c) for c in counts)


def _is_count(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 0


def hybrid_config(meta: Metadata, vocab_size: int, tied: bool, types: tuple[str, ...],
                  shape: ScanShape | None = None, **transformer: Any) -> ModelConfig:
    """The config of a transformer (architecture.transformer_config with the `transformer`
    keywords) whose layers are `types`: its attention layers' KV heads and its FFN layers' width
    from the per-layer counts, its recurrent layers of `shape` (default Mamba-2's), and each layer's
    memory declared."""
    kv = per_layer(meta, "attention.head_count_kv", len(types))
    ffn = per_layer(meta, "feed_forward_length", len(types))
    shape = shape or mamba2.scan_shape(meta)
    counts = {"attention.head_count_kv": _one(meta, "attention.head_count_kv", kv),
              "feed_forward_length": _one(meta, "feed_forward_length", ffn)
              or shape.heads * shape.head_dim}  # no FFN: the mixer's width stands for it in the estimates
    base = transformer_config(_with_counts(meta, counts), vocab_size, tied, **transformer)
    base = replace(base, recurrent=shape, recurrent_layers=tuple(t == "recurrent" for t in types),
                   layer_types=types)
    return replace(base, layer_kinds=tuple(_memory(base, t) for t in types))


LAYER_NAMES = {"recurrent": "a Mamba-2 layer", "attention": "an attention layer", "ffn": "an FFN-only layer"}


def layer_kind(config: ModelConfig, layer: int) -> str:
    """What the metadata makes of a layer, for a file whose tensors say otherwise."""
    return (f"layer {layer} is {LAYER_NAMES[config.layer_types[layer]]} by the metadata's per-layer "
            f"attention.head_count_kv and feed_forward_length")


def _one(meta: Metadata, key: str, counts: tuple[int, ...]) -> int | None:
    """The one count the layers that have any share (None: no layer has one): tierflow's KV cache
    holds one row shape for every attention layer, and its estimates one FFN width."""
    found = set(counts) - {0}
    if len(found) > 1:
        raise UnsupportedModelError(f"metadata '{meta.arch}.{key}' differs between layers ({sorted(found)}): "
                                    f"tierflow computes the layers that have one alike")
    return next(iter(found), None)


def _with_counts(meta: Metadata, counts: Mapping[str, int | None]) -> Metadata:
    """meta with each key's per-layer array replaced by its one count (None: left out), for the
    readers of one value."""
    metadata = {name: value for name, value in meta.metadata.items()
                if name.removeprefix(f"{meta.arch}.") not in counts}
    metadata.update({f"{meta.arch}.{key}": count for key, count in counts.items() if count is not None})
    return Metadata(metadata, meta.arch, meta.tensor_names)


def _memory(config: ModelConfig, layer_type: str) -> LayerMemory:
    if layer_type == "recurrent":
        return RecurrentState(config.recurrent)
    return FullCache(config.cache_rows) if layer_type == "attention" else NoMemory()
