"""A family's tensor map: which GGUF tensors a model needs, their shapes, and how they are grouped.

The map is what the rest of tierflow asks instead of knowing any family: the tensor checks read
names and shapes from it, the pack lays out each field of it as one array or one packed linear,
the planner's groups are its `group` labels, `tierflow convert` requantizes its matmuls, and the
tests' generator writes its tensors. A family's file builds its map from a few shared pieces
(`attention_fields`, `dense_ffn_fields`, ...) and its own.

A field is one thing a block computes with:
- `Vector`: float32 values used as they are (a norm's weight);
- `Matmul`: matrices that read the same input, computed as one linear whose output is theirs
  side by side (Q, K and V; gate and up), each with its bias where the family has one.
Fields come in extents: the globals, one per layer, and one per expert of a MoE layer (the unit
that is placed, streamed and cached); an expert's tensors are its slice of a stacked 3-D tensor.
"""

from dataclasses import dataclass

from tierflow.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class Tensor:
    name: str  # the GGUF name, e.g. "blk.3.attn_q.weight"
    shape: tuple[int, ...]  # GGUF order: ne0 (the row length) first; a stacked expert tensor's last
    # dimension is the expert
    expert: int | None = None  # this expert's slice of a stacked tensor

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(rows, columns) of the matrix this tensor (or its expert slice) is; a 1-D tensor is one row."""
        return (1, self.shape[0]) if len(self.shape) == 1 else (self.shape[1], self.shape[0])


@dataclass(frozen=True)
class Vector:
    tensor: Tensor
    optional: bool = False  # used when the file has it (e.g. Llama 3's rope_freqs)


@dataclass(frozen=True)
class Matmul:
    weights: tuple[Tensor, ...]
    bias: str = "none"  # "required", "optional" (used when the file has them) or "none"
    requantize: bool = True  # `tierflow convert` may requantize it (llama.cpp leaves routers alone)

    def bias_tensor(self, weight: Tensor) -> Tensor:
        """The weight's bias: one value per output row, a stacked expert tensor's [rows, experts]
        (of which an expert takes its slice, as of the weight)."""
        return Tensor(weight.name.removesuffix(".weight") + ".bias", weight.shape[1:], weight.expert)


Kind = Vector | Matmul


@dataclass(frozen=True)
class Field:
    name: str  # what the block calls it: "attn_norm", "qkv", "gate_up", ...
    kind: Kind
    group: str  # the planner's group: "embeddings", "output", "attention", "ffn", "router", "expert"


def vector(name: str, tensor: str, shape: tuple[int, ...], group: str, optional: bool = False) -> Field:
    return Field(name, Vector(Tensor(tensor, shape), optional), group)


def matmul(name: str, tensors: list[tuple[str, tuple[int, ...]]], group: str, bias: str = "none",
           requantize: bool = True, expert: int | None = None) -> Field:
    weights = tuple(Tensor(t, shape, expert) for t, shape in tensors)
    return Field(name, Matmul(weights, bias, requantize), group)


def global_fields(config: ModelConfig, rope_freqs: bool = False) -> list[Field]:
    """The embeddings, the output norm and head (none when tied to the embeddings) and, for
    families that read them, Llama-3 rope frequency factors."""
    e, v = config.hidden_size, config.vocab_size
    fields = [matmul("token_embd", [("token_embd.weight", (e, v))], "embeddings"),
              vector("output_norm", "output_norm.weight", (e,), "output")]
    if not config.tied_embeddings:
        fields.append(matmul("output", [("output.weight", (e, v))], "output"))
    if rope_freqs:
        fields.append(vector("rope_freqs", "rope_freqs.weight", (config.rope_dim // 2,), "output",
                             optional=True))
    return fields


def attention_fields(config: ModelConfig, layer: int, bias: str = "none", output_bias: str = "none"
                     ) -> list[Field]:
    """The attention of a pre-norm block: its norm, Q/K/V as one matmul (bias: theirs), the output
    projection (output_bias: its)."""
    e, p = config.hidden_size, f"blk.{layer}."
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return [vector("attn_norm", p + "attn_norm.weight", (e,), "attention"),
            matmul("qkv", [(p + "attn_q.weight", (e, q)), (p + "attn_k.weight", (e, kv)),
                           (p + "attn_v.weight", (e, kv))], "attention", bias),
            matmul("wo", [(p + "attn_output.weight", (q, e))], "attention", output_bias)]


def qk_norm_fields(config: ModelConfig, layer: int, per_head: bool, optional: bool = False) -> list[Field]:
    """RMSNorm weights of the queries and keys: one per head dimension (per_head), or over whole
    projections; used only where the file has them when `optional`."""
    p, d = f"blk.{layer}.", config.head_dim
    q, k = (d, d) if per_head else (config.num_heads * d, config.num_kv_heads * d)
    return [vector("q_norm", p + "attn_q_norm.weight", (q,), "attention", optional),
            vector("k_norm", p + "attn_k_norm.weight", (k,), "attention", optional)]


def ffn_norm_field(config: ModelConfig, layer: int, norm: str = "ffn_norm", group: str = "ffn") -> Field:
    """The pre-FFN norm, as the block calls it (ffn_norm), whatever the file names it (`norm`:
    GLM's is post_attention_norm)."""
    return vector("ffn_norm", f"blk.{layer}.{norm}.weight", (config.hidden_size,), group)


def dense_ffn_fields(config: ModelConfig, layer: int, norm: str = "ffn_norm") -> list[Field]:
    """A SwiGLU FFN: gate and up as one matmul, then down."""
    e, f, p = config.hidden_size, config.ffn_size, f"blk.{layer}."
    return [ffn_norm_field(config, layer, norm),
            matmul("gate_up", [(p + "ffn_gate.weight", (e, f)), (p + "ffn_up.weight", (e, f))], "ffn"),
            matmul("down", [(p + "ffn_down.weight", (f, e))], "ffn")]


def router_fields(config: ModelConfig, layer: int, norm: str = "ffn_norm") -> list[Field]:
    """A MoE layer's own extent beside its attention: its norm and router (the experts are
    extents of their own)."""
    e, n, p = config.hidden_size, config.num_experts, f"blk.{layer}."
    return [ffn_norm_field(config, layer, norm, "router"),
            matmul("router", [(p + "ffn_gate_inp.weight", (e, n))], "router", requantize=False)]


def selection_bias_field(config: ModelConfig, layer: int) -> Field:
    """exp_probs_b: a per-expert bias added to the router's scores to choose the experts, not to
    weight them (DeepSeek-V3, GLM-4.5)."""
    return vector("exp_probs_b", f"blk.{layer}.exp_probs_b.bias", (config.num_experts,), "router")


def shared_expert_fields(config: ModelConfig, layer: int, gated: bool = True) -> list[Field]:
    """An expert every token uses, scaled by a sigmoid gate (ffn_gate_inp_shexp, [hidden]) where
    `gated`."""
    e, s, p = config.hidden_size, config.shared_expert_ffn_size, f"blk.{layer}."
    fields = [matmul("shared_gate_up", [(p + "ffn_gate_shexp.weight", (e, s)),
                                        (p + "ffn_up_shexp.weight", (e, s))], "router"),
              matmul("shared_down", [(p + "ffn_down_shexp.weight", (s, e))], "router")]
    if gated:
        fields.append(matmul("shared_gate", [(p + "ffn_gate_inp_shexp.weight", (e,))], "router",
                             requantize=False))
    return fields


def expert_fields(config: ModelConfig, layer: int, expert: int, bias: str = "none") -> list[Field]:
    """One routed expert: its slices of the stacked gate, up and down tensors (and with bias, of
    their stacked biases)."""
    e, f, n, p = config.hidden_size, config.expert_ffn_size, config.num_experts, f"blk.{layer}."
    return [matmul("gate_up", [(p + "ffn_gate_exps.weight", (e, f, n)),
                               (p + "ffn_up_exps.weight", (e, f, n))], "expert", bias, expert=expert),
            matmul("down", [(p + "ffn_down_exps.weight", (f, e, n))], "expert", bias, expert=expert)]


def nextn_fields(config: ModelConfig, layer: int) -> list[Field]:
    """A multi-token-prediction block's own fields beside its layer's: the projection of the
    normed token embedding and normed hidden state side by side (eh_proj) and their norms, and
    the norm before the shared output head (the model's output_norm where the file has none)."""
    e, p = config.hidden_size, f"blk.{layer}.nextn."
    return [matmul("eh_proj", [(p + "eh_proj.weight", (2 * e, e))], "attention"),
            vector("enorm", p + "enorm.weight", (e,), "attention"),
            vector("hnorm", p + "hnorm.weight", (e,), "attention"),
            vector("head_norm", p + "shared_head_norm.weight", (e,), "attention", optional=True)]


def field_tensors(field: Field, present: set[str] | dict) -> list[tuple[Tensor, bool]]:
    """The tensors a field reads, each with whether it is required; optional ones only when the
    file has them (`present`: the file's tensor names)."""
    kind = field.kind
    if isinstance(kind, Vector):
        return [(kind.tensor, not kind.optional)] if not kind.optional or kind.tensor.name in present else []
    tensors = [(weight, True) for weight in kind.weights]
    for weight in kind.weights:
        bias = kind.bias_tensor(weight)
        if kind.bias == "required" or kind.bias == "optional" and bias.name in present:
            tensors.append((bias, kind.bias == "required"))
    return tensors
