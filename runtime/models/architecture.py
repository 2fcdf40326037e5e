"""Architecture: everything particular to one model family, as the rest of tierflow asks for it.

A family's file in `runtime/models/` builds one: how its metadata becomes a `ModelConfig`, its
tensor map (tensor_map.py: globals, each layer's fields, each expert's), and its block (how one
layer computes, with the shared parts of layers.py). The decoder loop, the pack, the planner, the
checks, `tierflow convert` and `info` and the tests' generator ask it; none of them names a family.
"""

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.compute.interfaces import Block
from tierflow.runtime.models import tensor_map
from tierflow.runtime.models.config import Metadata, ModelConfig, rope_scaling
from tierflow.runtime.models.tensor_map import Field


def no_experts(config: ModelConfig, layer: int, expert: int) -> list[Field]:
    return []


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    config: Callable[[Metadata, int, bool], ModelConfig]  # (metadata, vocabulary size, tied embeddings)
    layer_fields: Callable[[ModelConfig, int], list[Field]]  # a layer's extent
    block: Block
    expert_fields: Callable[[ModelConfig, int, int], list[Field]] = no_experts  # a MoE layer's experts
    global_fields: Callable[[ModelConfig], list[Field]] = tensor_map.global_fields
    summary: str = ""  # what tells it apart, for `tierflow info`
    layer_kind: Callable[[ModelConfig, int], str] | None = None  # where layers differ: what the metadata
    # makes of one (named when its tensors are missing)
    # the fields of the multi-token-prediction block after the last layer (block_count counts it),
    # computed by `block` as the one layer of config.mtp_config(); None: the family runs no such block
    mtp_fields: Callable[[ModelConfig], list[Field]] | None = None

    def read_config(self, metadata: dict[str, Any], vocab_size: int, tied: bool,
                    tensor_names: Collection[str] = frozenset()) -> ModelConfig:
        """The config from the file's metadata and, where the family reads them, its tensors' names."""
        return self.config(Metadata(metadata, self.name, tensor_names), vocab_size, tied)


def transformer_config(meta: Metadata, vocab_size: int, tied: bool, *, rope_style: str,
                       experts: str = "never", expert_ffn_key: bool = False,
                       shared_expert: bool = False) -> ModelConfig:
    """The config of a Llama-like decoder from the keys they all share. experts: "never" (dense),
    "optional" (MoE when expert_count is set) or "always"; expert_ffn_key: each expert's width is
    expert_feed_forward_length (without it, llama.cpp's feed_forward_length / expert_used_count;
    else feed_forward_length); shared_expert: a shared expert as wide
    as expert_shared_feed_forward_length (else feed_forward_length)."""
    hidden, heads = meta.count("embedding_length"), meta.count("attention.head_count")
    head_dim = meta.count("attention.key_length", max(hidden // heads, 1))
    if meta.count("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{meta.arch}.attention.value_length differs from key_length "
                                    f"{head_dim}: values as wide as keys are all tierflow computes")
    ffn = meta.count("feed_forward_length")
    num_experts = 0 if experts == "never" else meta.count(
        "expert_count", 0 if experts == "optional" else None, minimum=0 if experts == "optional" else 2)
    moe = num_experts > 0
    used = meta.count("expert_used_count", maximum=num_experts) if moe else 0
    expert_ffn = ffn
    if moe and expert_ffn_key:
        expert_ffn = meta.count("expert_feed_forward_length", max(ffn // used, 1))
    return ModelConfig(
        arch=meta.arch,
        name=meta.text("general.name", meta.arch, general=True),
        num_layers=meta.count("block_count"),
        hidden_size=hidden,
        ffn_size=ffn,
        num_heads=heads,
        num_kv_heads=meta.count("attention.head_count_kv", heads),
        head_dim=head_dim,
        vocab_size=vocab_size,
        context_length=meta.count("context_length", maximum=1 << 40),
        rms_norm_eps=meta.number("attention.layer_norm_rms_epsilon"),
        rope_theta=meta.number("rope.freq_base", 10000.0),
        rope_dim=meta.count("rope.dimension_count", head_dim),
        rope_scaling=rope_scaling(meta),
        tied_embeddings=tied,
        rope_style=rope_style,
        num_experts=num_experts,
        experts_used=used,
        expert_ffn_size=expert_ffn if moe else 0,
        shared_expert_ffn_size=(meta.count("expert_shared_feed_forward_length", ffn)
                                if moe and shared_expert else 0),
    )


GATING_FUNCTIONS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's llama_expert_gating_func_type values


def expert_gating(meta: Metadata, default: str) -> str:
    """The routers' gating function, `expert_gating_func` (llama.cpp's numbering; 0 or no key:
    the family's default). One the family does not define is a ModelFileError naming it."""
    code = meta.count("expert_gating_func", 0, minimum=0)
    if code and code not in GATING_FUNCTIONS:
        raise ModelFileError(f"{meta.arch}.expert_gating_func is {code}: a {meta.arch} model routes by "
                             f"{' or '.join(f'{n} ({name})' for n, name in GATING_FUNCTIONS.items())}")
    return GATING_FUNCTIONS.get(code, default)


def check_layer_count(config: ModelConfig, num_tensors: int) -> None:
    """A layer count the file cannot hold is refused before anything is built per layer (a
    header claiming 10^9 layers would otherwise grow lists of names without bound)."""
    if config.num_layers > num_tensors:
        raise ModelFileError(f"block_count is {config.num_layers} but the file holds only {num_tensors} "
                             f"tensors: at least one per layer is needed")
