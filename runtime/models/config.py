"""ModelConfig, the hyper-parameters every decoder shares, and `Metadata`, typed reads of a GGUF
file's metadata.

Which keys a family reads, and what it makes of them, is the family's business (its file in
`runtime/models/`); this module knows no architecture. Metadata comes from a file tierflow treats
as hostile: every read checks the value's type and range, so a wrong one is a `ModelFileError`
naming the key, never a TypeError from deep inside.
"""

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.kv_types import CacheRows
from tierflow.runtime.memory.kinds import FullCache, LatentCache, LayerMemory, RecurrentState, RingCache
from tierflow.runtime.memory.state_shapes import StateShape

MAX_DIMENSION = 1 << 24  # no real model has a width, head count or layer count near this


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as GGUF describes it: none, linear (position interpolation) or YaRN.

    Per-frequency factors, where a family has them, come as the tensor `rope_freqs.weight`.
    """

    kind: str = "none"  # "none" | "linear" | "yarn"
    factor: float = 1.0
    original_context_length: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attn_factor: float = 1.0  # YaRN's rotary magnitude, 1 + 0.1 ln(factor), is multiplied by it

    def __post_init__(self) -> None:
        if not math.isfinite(self.attn_factor) or self.attn_factor <= 0:
            raise ModelFileError(f"rope attention factor must be a positive number, got {self.attn_factor}")
        if self.kind not in ("none", "linear", "yarn"):
            raise UnsupportedModelError(f"rope scaling type {self.kind!r} is not supported")
        if not math.isfinite(self.factor) or self.factor <= 0:
            raise ModelFileError(f"rope scaling factor must be a positive number, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rope_dim: int
    rope_scaling: RopeScaling
    tied_embeddings: bool
    rope_style: str = "normal"  # "normal": adjacent pairs (x0, x1) rotate; "neox": the two halves;
    # "none": no rotary at all (Nemotron-H's and Granite 4.0-H's attention: positions come from the
    # recurrent layers)
    num_experts: int = 0  # 0: a dense FFN in every layer
    experts_used: int = 0  # experts each token is routed to
    expert_ffn_size: int = 0
    shared_expert_ffn_size: int = 0  # an expert every token uses beside the routed ones; 0: none
    leading_dense_layers: int = 0  # a MoE model's first layers with a dense FFN instead of experts
    # Which layers' FFN is a mixture of experts where they are not the layers after the leading dense
    # ones (Jamba's every other layer), one flag per layer; () derives them from leading_dense_layers.
    expert_layers: tuple[bool, ...] = ()
    # How a router's logits become expert weights (llama.cpp's build_moe_ffn): the gating function
    # ("softmax" or "sigmoid" over every expert, llama.cpp's expert_gating_func, or "softmax_weight":
    # the top k raw logits, then a softmax over those k), whether the chosen experts' weights are
    # rescaled to sum to 1, and a factor they are multiplied by after.
    expert_gating: str = "softmax"
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    # Sliding-window attention: each layer's window in positions (a token sees itself and the
    # window - 1 before it), 0 for a layer that sees the whole context; () when no layer slides.
    layer_windows: tuple[int, ...] = ()
    # Rotary base of the sliding-window layers, which rotate unscaled (llama.cpp's
    # rope_freq_base_train_swa with a scale of 1); 0: they rotate as the other layers.
    sliding_rope_theta: float = 0.0
    embedding_scale: float = 1.0  # the embeddings' rows are multiplied by it (Gemma: sqrt(hidden))
    residual_scale: float = 1.0  # what a block's mixer and FFN outputs are multiplied by before each joins
    # the residual stream, where the family's block reads it (Granite's residual multiplier)
    logit_scale: float = 1.0  # the output logits are divided by it (Granite's logits scaling)
    attention_scale: float = 0.0  # queries' scale before the softmax; 0: head_dim ** -0.5
    # Soft caps, cap * tanh(x / cap), of the attention scores and of the output logits; 0: none.
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Multi-head latent attention (deepseek2): keys and values compressed into a latent of this
    # width, cached once per position with the rotary part of the keys (rope_dim); 0: per-head KV.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # MLA's low-rank queries' width; 0: one plain query projection
    value_head_dim: int = 0  # each head's value width where it differs from head_dim; 0: head_dim
    # Grouped expert selection (DeepSeek-V3): the experts form expert_groups equal groups, and a
    # token chooses only among the expert_groups_used groups whose two best scores sum highest.
    expert_groups: int = 1
    expert_groups_used: int = 1
    # Recurrent layers (Qwen3.5's and Qwen3-Next's linear attention, Mamba's): which layers carry a
    # recurrent state (`recurrent`'s shape) instead of a KV cache; () when none does.
    recurrent_layers: tuple[bool, ...] = ()
    recurrent: StateShape | None = None
    # Multi-token-prediction blocks in the file after the num_layers that run (`nextn_predict_layers`):
    # what `--draft mtp` drafts with (speculative/mtp.py) where the family computes them.
    nextn_layers: int = 0
    ssm_time_step_rank: int = 0  # Mamba-1's time steps' low-rank projection (ssm_x's first outputs); 0: none
    ssm_dt_b_c_rms: bool = False  # Falcon-Mamba's: Mamba-1's dt, B and C RMS-normed, with no weight
    moe_latent_size: int = 0  # Nemotron-3 Super's: experts compute in a latent width (0: the hidden size)
    # Each layer's kind of memory (runtime/memory/kinds.py) where the family declares it: a kind the
    # fields above do not imply (a new state, say) is declared here; () derives it from them.
    layer_kinds: tuple[LayerMemory, ...] = ()
    # Each layer's kind of block where a family's layers differ beyond recurrent_layers (Nemotron-H's
    # "recurrent", "attention" and "ffn" layers), as the family names them; () where they do not.
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads",
                    "head_dim", "vocab_size", "context_length")
        for field in positive:
            if getattr(self, field) <= 0:
                raise ModelFileError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFileError(
                f"head count {self.num_heads} is not a multiple of KV head count {self.num_kv_heads}"
            )
        if self.rope_dim > self.head_dim or self.rope_dim % 2 or self.rope_dim <= 0:
            raise ModelFileError(f"rope dimension {self.rope_dim} does not fit head size {self.head_dim}")
        if self.rope_style not in ("normal", "neox", "none"):
            raise ModelFileError(f"rope style must be 'normal', 'neox' or 'none', not {self.rope_style!r}")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 1:
            raise ModelFileError(f"rope frequency base must be a number above 1, got {self.rope_theta}")
        if not math.isfinite(self.rms_norm_eps) or not 0 < self.rms_norm_eps < 1:
            raise ModelFileError(f"RMS norm epsilon must be in (0, 1), got {self.rms_norm_eps}")
        if self.num_experts and not 1 <= self.experts_used <= self.num_experts:
            raise ModelFileError(f"expert_used_count must be 1..{self.num_experts} (the expert count), "
                                 f"got {self.experts_used}")
        if self.num_experts and self.expert_ffn_size <= 0:
            raise ModelFileError(f"expert feed-forward size must be positive, got {self.expert_ffn_size}")
        self._check_routing()
        if self.layer_windows and (len(self.layer_windows) != self.num_layers
                                   or any(w < 0 for w in self.layer_windows)):
            raise ModelFileError(f"sliding windows must be one count >= 0 per layer ({self.num_layers}), "
                                 f"got {len(self.layer_windows)}")
        self._check_scales()
        self._check_latent()
        self._check_groups()
        for field in ("layer_kinds", "layer_types", "expert_layers"):
            if getattr(self, field) and len(getattr(self, field)) != self.num_layers:
                raise ModelFileError(f"{field.replace('_', ' ')} must be one per layer ({self.num_layers}), "
                                     f"got {len(getattr(self, field))}")
        layers = len(self.recurrent_layers)
        if self.recurrent_layers and (layers != self.num_layers or self.recurrent is None):
            raise ModelFileError(f"recurrent layers must be one flag per layer ({self.num_layers}) with a "
                                 f"state shape, got {len(self.recurrent_layers)}")

    def _check_groups(self) -> None:
        groups, used = self.expert_groups, self.expert_groups_used
        if groups < 1 or not 1 <= used <= groups or self.num_experts % groups:
            raise ModelFileError(f"expert_group_count {groups} must divide the {self.num_experts} experts "
                                 f"and expert_group_used_count {used} be 1..{groups}")
        if groups > 1 and self.experts_used > used * (self.num_experts // groups):
            raise ModelFileError(f"expert_used_count {self.experts_used} exceeds the experts of the "
                                 f"{used} groups used ({used * (self.num_experts // groups)})")

    def _check_latent(self) -> None:
        """MLA's widths, where a file sets them."""
        for field in ("kv_lora_rank", "q_lora_rank", "value_head_dim"):
            if getattr(self, field) < 0:
                raise ModelFileError(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.kv_lora_rank and self.rope_dim >= self.head_dim:
            raise ModelFileError(f"rope dimension {self.rope_dim} leaves no unrotated part of the key "
                                 f"head size {self.head_dim} for the latent attention")

    def _check_routing(self) -> None:
        if not 0 <= self.leading_dense_layers <= self.num_layers:
            raise ModelFileError(f"leading_dense_block_count must be 0..{self.num_layers} (the layer count), "
                                 f"got {self.leading_dense_layers}")
        if self.expert_layers and not self.num_experts:
            raise ModelFileError("expert layers are named but the model has no experts (expert_count 0)")
        if self.expert_gating not in ("softmax", "sigmoid", "softmax_weight"):
            raise ModelFileError(f"expert gating function must be softmax, sigmoid or softmax_weight, "
                                 f"not {self.expert_gating!r}")
        if not (math.isfinite(self.expert_weights_scale) and self.expert_weights_scale > 0):
            raise ModelFileError(f"expert_weights_scale must be a positive number, "
                                 f"got {self.expert_weights_scale}")

    def _check_scales(self) -> None:
        """The Gemma-style constants, where a file sets them: finite, and 0 only where 0 means none."""
        theta = self.sliding_rope_theta
        if theta and not (math.isfinite(theta) and theta > 1):
            raise ModelFileError(f"sliding-window rope frequency base must be a number above 1, "
                                 f"got {self.sliding_rope_theta}")
        if not (math.isfinite(self.embedding_scale) and self.embedding_scale > 0):
            raise ModelFileError(f"embedding scale must be a positive number, got {self.embedding_scale}")
        for field in ("residual_scale", "logit_scale"):
            if not (math.isfinite(getattr(self, field)) and getattr(self, field) > 0):
                raise ModelFileError(f"{field} must be a positive number, got {getattr(self, field)}")
        for field in ("attention_scale", "attn_logit_softcap", "final_logit_softcap"):
            if not (math.isfinite(getattr(self, field)) and getattr(self, field) >= 0):
                raise ModelFileError(f"{field} must be a number >= 0, got {getattr(self, field)}")

    def is_recurrent(self, layer: int) -> bool:
        """Whether the layer carries a recurrent state instead of a KV cache."""
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    def first_layers(self, num_layers: int) -> "ModelConfig":
        """The config of the model made of its first num_layers layers."""
        return replace(self, num_layers=num_layers, layer_windows=self.layer_windows[:num_layers],
                       recurrent_layers=self.recurrent_layers[:num_layers],
                       layer_kinds=self.layer_kinds[:num_layers], layer_types=self.layer_types[:num_layers],
                       leading_dense_layers=min(self.leading_dense_layers, num_layers),
                       expert_layers=self.expert_layers[:num_layers])

    def mtp_config(self) -> "ModelConfig":
        """The config of the multi-token-prediction block as a one-layer model: a full-attention
        layer with the model's FFN (its experts too, in a MoE model)."""
        return replace(self, num_layers=1, layer_windows=(0,) if self.layer_windows else (),
                       recurrent_layers=(), recurrent=None, leading_dense_layers=0, nextn_layers=0,
                       layer_kinds=(), layer_types=(), expert_layers=())

    def window(self, layer: int) -> int:
        """The layer's sliding window in positions, 0 if it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def query_scale(self) -> float:
        """What attention scores are multiplied by before the softmax."""
        return self.attention_scale or self.head_dim ** -0.5

    @property
    def cache_rows(self) -> CacheRows:
        """What each layer's KV cache holds per position: a key and a value row per KV head, or
        with latent attention one row of the rotary key part and the latent (values read it)."""
        if self.kv_lora_rank:
            return CacheRows(1, self.rope_dim + self.kv_lora_rank, 0, latent=True, rotary_dim=self.rope_dim)
        return CacheRows(self.num_kv_heads, self.head_dim, self.head_dim)

    @property
    def memory(self) -> tuple[LayerMemory, ...]:
        """What each layer keeps for a sequence (runtime/memory/kinds.py): the KV cache allocates
        these and the planner counts them, neither branching on the kind."""
        return tuple(self.layer_memory(layer) for layer in range(self.num_layers))

    def layer_memory(self, layer: int) -> LayerMemory:
        """The layer's kind of memory, as the family declares it (`layer_kinds`) or its fields imply:
        a recurrent state, a latent row, a sliding window's ring, or else the whole context's rows."""
        if self.layer_kinds:
            return self.layer_kinds[layer]
        if self.is_recurrent(layer):
            return RecurrentState(self.recurrent)
        rows = self.cache_rows
        if rows.latent:
            return LatentCache(rows)
        window = self.window(layer)
        return RingCache(rows, window) if window else FullCache(rows)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def has_experts(self, layer: int) -> bool:
        """Whether the layer's FFN is a mixture of experts: as `expert_layers` names it, else every
        layer of a MoE model after its leading dense ones."""
        if self.expert_layers:
            return self.expert_layers[layer]
        return self.is_moe and layer >= self.leading_dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose FFN is a mixture of experts, in order."""
        return tuple(layer for layer in range(self.num_layers) if self.has_experts(layer))


class Metadata:
    """Typed reads of one architecture's keys (`{arch}.{key}`) and of `general.*`.

    A required key that is missing, or any key whose value has the wrong type or lies outside
    its range, is a ModelFileError naming the key.
    """

    def __init__(self, metadata: Mapping[str, Any], arch: str, tensor_names: Collection[str] = frozenset()):
        self.metadata, self.arch, self.tensor_names = metadata, arch, tensor_names

    def count(self, key: str, default: int | None = None, *, minimum: int = 1,
              maximum: int = MAX_DIMENSION) -> int:
        """An integer in [minimum, maximum] (sizes, counts, lengths)."""
        name, value = self._get(key, default)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ModelFileError(f"metadata '{name}' must be an integer, got {_shown(value)}")
        if not minimum <= value <= maximum:
            raise ModelFileError(f"metadata '{name}' must be in {minimum}..{maximum}, got {value}")
        return int(value)

    def number(self, key: str, default: float | None = None) -> float:
        """A finite number."""
        name, value = self._get(key, default)
        numeric = (int, float, np.integer, np.floating)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numeric):
            raise ModelFileError(f"metadata '{name}' must be a number, got {_shown(value)}")
        if not math.isfinite(value):
            raise ModelFileError(f"metadata '{name}' must be finite, got {value}")
        return float(value)

    def flag(self, key: str, default: bool | None = None) -> bool:
        """A boolean."""
        name, value = self._get(key, default)
        if not isinstance(value, (bool, np.bool_)):
            raise ModelFileError(f"metadata '{name}' must be a boolean, got {_shown(value)}")
        return bool(value)

    def text(self, key: str, default: str | None = None, *, general: bool = False) -> str:
        name, value = self._get(key, default, general)
        if not isinstance(value, str):
            raise ModelFileError(f"metadata '{name}' must be a string, got {_shown(value)}")
        return value

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.metadata

    def has_tensor(self, name: str) -> bool:
        """Whether the file holds the tensor (where a family tells its layers apart by their tensors,
        as llama.cpp does Jamba's MoE layers)."""
        return name in self.tensor_names

    def _get(self, key: str, default: Any, general: bool = False) -> tuple[str, Any]:
        name = key if general else f"{self.arch}.{key}"
        value = self.metadata.get(name)
        if value is None:
            if default is None:
                raise ModelFileError(f"missing required metadata '{name}'")
            return name, default
        return name, value


def _shown(value: Any) -> str:
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)} values"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def rope_scaling(meta: Metadata) -> RopeScaling:
    """The rotary scaling the metadata describes (the older `rope.scale_linear` spelling too)."""
    kind = meta.text("rope.scaling.type", "none")
    factor = meta.number("rope.scaling.factor", 1.0)
    if kind == "none" and meta.has("rope.scale_linear"):
        kind, factor = "linear", meta.number("rope.scale_linear")
    if kind == "none" or factor == 1.0 and kind == "linear":
        return RopeScaling()
    return RopeScaling(kind=kind, factor=factor,
                       original_context_length=meta.count("rope.scaling.original_context_length", 0,
                                                          minimum=0, maximum=1 << 40))
