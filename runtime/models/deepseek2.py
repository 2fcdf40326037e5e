"""DeepSeek-V2/V2-Lite/V3, Moonlight, Kimi K2 (`deepseek2`): multi-head latent attention
(latent_attention.py: low-rank queries through attn_q_a, attn_q_a_norm and attn_q_b where
`attention.q_lora_rank` is set, else one attn_q; keys and values compressed into a latent of
`attention.kv_lora_rank` and a rotary part of `rope.dimension_count`, rotated as adjacent pairs;
one row of both cached per position) and a mixture of experts: softmax or sigmoid scores
(`expert_gating_func` 1 or 2; older files without it are softmax), the top `expert_used_count`
chosen by score plus the selection-only bias `exp_probs_b` where the file has one, weighted by
their scores, renormalised with `expert_weights_norm` and scaled by `expert_weights_scale`, and
`expert_shared_count` shared experts (one SwiGLU as wide as that many experts) every token uses.

Only files in llama.cpp's current form are read: the per-head `attn_k_b` and `attn_v_b`
(`attention.key_length_mla`, `value_length_mla`); older ones with one `attn_kv_b` are refused.

YaRN scales the scores as llama.cpp's deepseek2 graph does: by mscale^2 / sqrt(head size), mscale
= 1 + 0.1 * log_mul * ln(factor) with log_mul `rope.scaling.yarn_log_multiplier` / 0.1 (the
converter writes it times 0.1), the rotary magnitude then 1; without that key mscale is YaRN's
usual 1 + 0.1 ln(factor), which the rotary rows also carry.
"""

import math
from dataclasses import replace

import numpy as np
import torch

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.config import Metadata, ModelConfig, rope_scaling
from tierflow.runtime.model import Activations, LayerPass, Weights
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.latent_attention import latent_attention
from tierflow.runtime.models.layers import routed_experts, swiglu

GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values this family uses
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the chosen weights' sum to float16's smallest normal


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    hidden, heads = meta.count("embedding_length"), meta.count("attention.head_count")
    if not meta.has("attention.key_length_mla"):
        raise UnsupportedModelError(f"{meta.arch}: this file has no attention.key_length_mla, so it is in "
                                    f"the older form with one attn_kv_b per layer; tierflow reads the "
                                    f"current form (attn_k_b and attn_v_b): convert it again with "
                                    f"llama.cpp's convert_hf_to_gguf.py")
    latent, rope_dim = meta.count("attention.kv_lora_rank"), meta.count("rope.dimension_count")
    _check_cache_widths(meta, latent, rope_dim)
    num_experts = meta.count("expert_count", minimum=2)
    expert_ffn = meta.count("expert_feed_forward_length")
    return ModelConfig(
        arch=meta.arch, name=meta.text("general.name", meta.arch, general=True),
        num_layers=meta.count("block_count"), hidden_size=hidden,
        ffn_size=meta.count("feed_forward_length"), num_heads=heads,
        num_kv_heads=1,  # the latent row, shared by every head
        head_dim=meta.count("attention.key_length_mla"), vocab_size=vocab_size,
        context_length=meta.count("context_length", maximum=1 << 40),
        rms_norm_eps=meta.number("attention.layer_norm_rms_epsilon"),
        rope_theta=meta.number("rope.freq_base", 10000.0), rope_dim=rope_dim,
        rope_scaling=_rope_scaling(meta), tied_embeddings=tied, rope_style="normal",
        num_experts=num_experts, experts_used=meta.count("expert_used_count", maximum=num_experts),
        expert_ffn_size=expert_ffn,
        shared_expert_ffn_size=expert_ffn * meta.count("expert_shared_count"),
        attention_scale=_query_scale(meta, meta.count("attention.key_length_mla")),
        kv_lora_rank=latent, q_lora_rank=meta.count("attention.q_lora_rank", 0, minimum=0),
        value_head_dim=meta.count("attention.value_length_mla"),
        expert_gating=_gating(meta), expert_weights_norm=_flag(meta, "expert_weights_norm"),
        expert_weights_scale=meta.number("expert_weights_scale", 0.0),
        leading_dense_layers=_leading_dense_layers(meta),
    )


def _check_cache_widths(meta: Metadata, latent: int, rope_dim: int) -> None:
    """attention.key_length and value_length, where written, are the cached row's widths in the
    absorbed form (what llama.cpp sizes its cache by): they must agree with the latent's."""
    for key, width in (("attention.key_length", latent + rope_dim), ("attention.value_length", latent)):
        if meta.has(key) and meta.count(key) != width:
            raise ModelFileError(f"metadata '{meta.arch}.{key}' is {meta.count(key)}, but kv_lora_rank "
                                 f"{latent} and rope dimension {rope_dim} make it {width}")


def _gating(meta: Metadata) -> str:
    code = meta.count("expert_gating_func", 1, minimum=0)
    gating = GATING.get(code or 1)  # 0: not set, softmax as in the DeepSeek-V2 files before the key
    if gating is None:
        raise ModelFileError(f"metadata '{meta.arch}.expert_gating_func' is {code}: {meta.arch} gates its "
                             f"experts by softmax (1) or sigmoid (2)")
    return gating


def _flag(meta: Metadata, key: str) -> bool:
    value = meta.metadata.get(f"{meta.arch}.{key}", False)
    if not isinstance(value, (bool, np.bool_)):
        raise ModelFileError(f"metadata '{meta.arch}.{key}' must be a boolean, got {value!r:.40}")
    return bool(value)


def _leading_dense_layers(meta: Metadata) -> int:
    count = meta.count("leading_dense_block_count", 0, minimum=0)
    if count:
        raise UnsupportedModelError(f"{meta.arch}: leading dense layers (leading_dense_block_count {count}) "
                                    f"are not supported yet: every layer must be a mixture of experts")
    if meta.count("expert_group_count", 1, minimum=0) > 1:
        raise UnsupportedModelError(f"{meta.arch}: grouped expert selection (expert_group_count) is not "
                                    f"supported")
    return count


def _rope_scaling(meta: Metadata):
    """YaRN's rotary magnitude is 1 where the file sets yarn_log_multiplier (see the module's
    docstring), else 1 + 0.1 ln(factor) as for other families."""
    scaling = rope_scaling(meta)
    if scaling.kind == "yarn" and _log_multiplier(meta):
        return replace(scaling, attn_factor=1.0 / (1.0 + 0.1 * math.log(scaling.factor)))
    return scaling


def _log_multiplier(meta: Metadata) -> float:
    return meta.number("rope.scaling.yarn_log_multiplier", 0.0) / 0.1


def _query_scale(meta: Metadata, head_dim: int) -> float:
    """llama.cpp's kq_scale, mscale^2 / sqrt(head size), in float32."""
    scaling = rope_scaling(meta)
    stretch = math.log(scaling.factor) if scaling.kind == "yarn" and scaling.factor > 1 else 0.0
    log_mul = _log_multiplier(meta)
    magnitude = 1.0 if log_mul else 1.0 + 0.1 * stretch
    mscale = np.float32(magnitude) * np.float32(1.0 + 0.1 * log_mul * stretch)
    return float(mscale * mscale / np.sqrt(np.float32(head_dim)))


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return attention_fields(config, layer) + tm.router_fields(config, layer) + moe_extras(config, layer)


def attention_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    """The latent attention's weights (shapes in GGUF order)."""
    e, h, p = config.hidden_size, config.num_heads, f"blk.{layer}."
    latent, rope, q = config.kv_lora_rank, config.rope_dim, config.num_heads * config.head_dim
    unrotated, v = config.head_dim - rope, config.value_head_dim
    if config.q_lora_rank:
        r = config.q_lora_rank
        queries = [tm.matmul("q_a", [(p + "attn_q_a.weight", (e, r))], "attention"),
                   tm.vector("q_a_norm", p + "attn_q_a_norm.weight", (r,), "attention"),
                   tm.matmul("q_b", [(p + "attn_q_b.weight", (r, q))], "attention")]
    else:
        queries = [tm.matmul("q", [(p + "attn_q.weight", (e, q))], "attention")]
    return [tm.vector("attn_norm", p + "attn_norm.weight", (e,), "attention"), *queries,
            tm.matmul("kv_a", [(p + "attn_kv_a_mqa.weight", (e, latent + rope))], "attention"),
            tm.vector("kv_a_norm", p + "attn_kv_a_norm.weight", (latent,), "attention"),
            tm.vector("k_b", p + "attn_k_b.weight", (unrotated, latent, h), "attention"),
            tm.vector("v_b", p + "attn_v_b.weight", (latent, v, h), "attention"),
            tm.matmul("wo", [(p + "attn_output.weight", (h * v, e))], "attention")]


def moe_extras(config: ModelConfig, layer: int) -> list[tm.Field]:
    """The selection bias (where the file has one) and the ungated shared experts."""
    e, s, p = config.hidden_size, config.shared_expert_ffn_size, f"blk.{layer}."
    return [tm.vector("exp_probs_b", p + "exp_probs_b.bias", (config.num_experts,), "router", optional=True),
            tm.matmul("shared_gate_up", [(p + "ffn_gate_shexp.weight", (e, s)),
                                         (p + "ffn_up_shexp.weight", (e, s))], "router"),
            tm.matmul("shared_down", [(p + "ffn_down_shexp.weight", (s, e))], "router")]


def route(config: ModelConfig, bias: torch.Tensor | None, logits: torch.Tensor, k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's build_moe_ffn for this family: scores by softmax or sigmoid; the top k by score
    plus the selection bias; their unbiased scores as weights, renormalised and scaled as the
    config says. logits [T, N] -> weights, chosen experts [T, k]."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if config.expert_gating == "softmax" else torch.sigmoid(logits)
    selection = scores if bias is None else scores + bias.to(scores.device)
    chosen = selection.topk(k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    if config.expert_weights_norm:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=MIN_WEIGHT_SUM)
    if config.expert_weights_scale not in (0.0, 1.0):
        weights = weights * np.float32(config.expert_weights_scale)
    return weights, chosen


def moe(p: LayerPass, w: Weights, h: Activations, residual: Activations) -> Activations:
    """The routed experts' weighted sum plus the shared experts'."""
    bias = w.fields.get("exp_probs_b")
    bias = None if bias is None else torch.as_tensor(bias)
    out = routed_experts(p, w, h, residual, lambda logits, k: route(p.config, bias, logits, k))
    shared = swiglu(p.kernels, w.shared_gate_up, w.shared_down, h)
    out += torch.as_tensor(shared).to(out.device)
    return p.kernels.take(out)


def block(x: Activations, w: Weights, p: LayerPass) -> Activations:
    """x + latent attention(norm(x)), then + moe(norm(x))."""
    kernels, eps = p.kernels, p.config.rms_norm_eps
    attended = latent_attention(p, w, kernels.rms_norm(x, w.attn_norm, eps))
    h = kernels.add_rms_norm(x, attended, w.ffn_norm, eps)
    x += moe(p, w, h, x)
    return x


ARCHITECTURE = Architecture(name="deepseek2", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields,
                            summary="multi-head latent attention (a latent KV cache); softmax or sigmoid "
                                    "top-k experts with a selection bias; shared experts")
