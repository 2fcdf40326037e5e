"""The tensors a model needs: their names and shapes, checked against the header."""

from tierflow.cpu_kernels.dequant import SUPPORTED_TYPES
from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.offload.gguf.reader import GGUFFile
from tierflow.runtime.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF shapes (ne0 first) of every tensor the decoder needs, keyed by tensor name."""
    e, v = config.hidden_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"token_embd.weight": (e, v), "output_norm.weight": (e,)}
    if not config.tied_embeddings:
        shapes["output.weight"] = (e, v)
    for i in range(config.num_layers):
        layer = {
            "attn_norm.weight": (e,), "attn_q.weight": (e, q), "attn_k.weight": (e, kv),
            "attn_v.weight": (e, kv), "attn_output.weight": (q, e), "ffn_norm.weight": (e,),
        }
        if config.qkv_bias:
            layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
        if config.qk_norm:
            layer |= {"attn_q_norm.weight": (q,), "attn_k_norm.weight": (kv,)}
        layer |= _ffn_shapes(config) if not config.is_moe else _moe_shapes(config)
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _ffn_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, f = config.hidden_size, config.ffn_size
    return {"ffn_gate.weight": (e, f), "ffn_up.weight": (e, f), "ffn_down.weight": (f, e)}


def _moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The router and the experts, stacked in 3-D tensors (one slice per expert), and qwen2moe's
    shared expert with its gate."""
    e, f, n = config.hidden_size, config.expert_ffn_size, config.num_experts
    shapes = {"ffn_gate_inp.weight": (e, n), "ffn_gate_exps.weight": (e, f, n),
              "ffn_up_exps.weight": (e, f, n), "ffn_down_exps.weight": (f, e, n)}
    if config.shared_expert_ffn_size:
        s = config.shared_expert_ffn_size
        shapes |= {"ffn_gate_inp_shexp.weight": (e,), "ffn_gate_shexp.weight": (e, s),
                   "ffn_up_shexp.weight": (e, s), "ffn_down_shexp.weight": (s, e)}
    return shapes


def check_tensors(gguf: GGUFFile, config: ModelConfig) -> None:
    """Every needed tensor is present, of the right shape and of a type tierflow computes with."""
    for name, shape in expected_shapes(config).items():
        info = gguf.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{gguf.path.name}: missing tensor '{name}'")
        if info.shape != shape:
            raise ModelFileError(
                f"{gguf.path.name}: tensor '{name}' has shape {list(info.shape)}, "
                f"the metadata implies {list(shape)}"
            )
        if info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{gguf.path.name}: tensor '{name}' has type {info.type_name}, which tierflow "
                f"does not support yet"
            )
