"""ModelConfig: the architecture hyper-parameters, read from a GGUF file's metadata."""

from dataclasses import dataclass
from typing import Any

from tierflow.errors import ModelFileError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "olmoe")

# How each architecture pairs the rotary dimensions (llama.cpp's rope types): "normal" rotates
# adjacent pairs (x0, x1), "neox" rotates the two halves (x_i, x_{i+d/2}).
ROPE_STYLE = {"llama": "normal", "qwen2": "neox", "qwen2moe": "neox", "olmoe": "neox"}
QKV_BIAS = ("qwen2", "qwen2moe")  # attn_q/k/v carry biases
QK_NORM = ("olmoe",)  # RMSNorm of the whole query and key projections before rotary
MOE_ARCHITECTURES = ("qwen2moe", "olmoe")  # always MoE; a llama with expert_count is Mixtral-style


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as GGUF describes it: none, linear (position interpolation) or YaRN.

    Llama-3-style per-frequency factors come as the tensor `rope_freqs.weight`, not as metadata.
    """

    kind: str = "none"  # "none" | "linear" | "yarn"
    factor: float = 1.0
    original_context_length: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "yarn"):
            raise UnsupportedModelError(f"rope scaling type {self.kind!r} is not supported")
        if self.factor <= 0:
            raise ModelFileError(f"rope scaling factor must be positive, got {self.factor}")


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
    num_experts: int = 0  # 0: a dense FFN in every layer
    experts_used: int = 0  # experts each token is routed to
    expert_ffn_size: int = 0
    shared_expert_ffn_size: int = 0  # qwen2moe's shared expert, gated per token; 0: none

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        positive = ("num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads",
                    "head_dim", "vocab_size", "context_length")
        for field in positive:
            if getattr(self, field) <= 0:
                raise ModelFileError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFileError(
                f"head count {self.num_heads} is not a multiple of KV head count {self.num_kv_heads}"
            )
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ModelFileError(f"rope dimension {self.rope_dim} does not fit head size {self.head_dim}")
        if self.arch in MOE_ARCHITECTURES and not self.num_experts:
            raise ModelFileError(f"a {self.arch} model needs '{self.arch}.expert_count'")
        if self.num_experts and not 1 <= self.experts_used <= self.num_experts:
            raise ModelFileError(f"expert_used_count must be 1..{self.num_experts} (the expert count), "
                                 f"got {self.experts_used}")
        if self.num_experts and self.expert_ffn_size <= 0:
            raise ModelFileError(f"expert feed-forward size must be positive, got {self.expert_ffn_size}")

    @property
    def rope_style(self) -> str:
        return ROPE_STYLE[self.arch]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qkv_bias(self) -> bool:
        return self.arch in QKV_BIAS

    @property
    def qk_norm(self) -> bool:
        return self.arch in QK_NORM

    @property
    def renormalize_expert_weights(self) -> bool:
        """Whether the routed experts' softmax weights are rescaled to sum to 1 (Mixtral does;
        qwen2moe and OLMoE use them as they are, as llama.cpp does)."""
        return self.arch == "llama"

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], vocab_size: int, tied: bool) -> "ModelConfig":
        """Builds the config; a missing required key is a ModelFileError naming the key."""
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError("missing required metadata 'general.architecture'")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def required(key: str) -> Any:
            value = metadata.get(f"{arch}.{key}")
            if value is None:
                raise ModelFileError(f"missing required metadata '{arch}.{key}'")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ModelFileError(f"metadata '{arch}.{key}' must be a number, got {value!r}")
            return value

        def optional(key: str, default: Any) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            return default if value is None else value

        hidden = int(required("embedding_length"))
        num_heads = int(required("attention.head_count"))
        head_dim = int(optional("attention.key_length", hidden // max(num_heads, 1)))
        ffn_size = int(required("feed_forward_length"))
        num_experts = int(optional("expert_count", 0))
        return cls(
            arch=arch,
            name=str(metadata.get("general.name", arch)),
            num_layers=int(required("block_count")),
            hidden_size=hidden,
            ffn_size=ffn_size,
            num_heads=num_heads,
            num_kv_heads=int(optional("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=vocab_size,
            context_length=int(required("context_length")),
            rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
            rope_theta=float(optional("rope.freq_base", 10000.0)),
            rope_dim=int(optional("rope.dimension_count", head_dim)),
            rope_scaling=_rope_scaling(metadata, arch),
            tied_embeddings=tied,
            num_experts=num_experts,
            experts_used=int(required("expert_used_count")) if num_experts else 0,
            expert_ffn_size=int(optional("expert_feed_forward_length", ffn_size)) if num_experts else 0,
            shared_expert_ffn_size=int(optional("expert_shared_feed_forward_length", 0)),
        )


def _rope_scaling(metadata: dict[str, Any], arch: str) -> RopeScaling:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind == "none" and f"{arch}.rope.scale_linear" in metadata:  # older GGUF spelling
        kind, factor = "linear", float(metadata[f"{arch}.rope.scale_linear"])
    if kind == "none" or factor == 1.0 and kind == "linear":
        return RopeScaling()
    return RopeScaling(
        kind=str(kind),
        factor=factor,
        original_context_length=int(
            metadata.get(f"{arch}.rope.scaling.original_context_length", 0) or 0
        ),
    )
