"""DeepSeek-V2/V2-Lite/V3, Moonlight, Kimi K2 (`deepseek2`): multi-head latent attention
(latent_attention.py: low-rank queries through attn_q_a, attn_q_a_norm and attn_q_b where
`attention.q_lora_rank` is set, else one attn_q; keys and values compressed into a latent of
`attention.kv_lora_rank` and a rotary part of `rope.dimension_count`, rotated as adjacent pairs;
one row of both cached per position) and, after `leading_dense_block_count` dense layers
(`feed_forward_length` wide), a mixture of experts (layers.moe_ffn): softmax or sigmoid
scores (`expert_gating_func` 1 or 2; older files without it are softmax), the top
`expert_used_count` chosen by score plus the selection-only bias `exp_probs_b` where the file has
one, weighted by their scores, renormalised with `expert_weights_norm` and scaled by
`expert_weights_scale`, only among the `expert_group_used_count` best of `expert_group_count`
groups where a file groups them (V3's), and `expert_shared_count` shared experts (one ungated
SwiGLU as wide as that many experts) every token uses.

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

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, expert_gating
from tierflow.runtime.models.config import Metadata, ModelConfig, RopeScaling, rope_scaling
from tierflow.runtime.models.latent_attention import latent_attention
from tierflow.runtime.models.layers import dense_ffn, moe_ffn


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
        expert_gating=expert_gating(meta, "softmax"),
        expert_weights_norm=meta.flag("expert_weights_norm", False),
        expert_weights_scale=meta.number("expert_weights_scale", 0.0) or 1.0,  # 0: not scaled, as llama.cpp
        leading_dense_layers=meta.count("leading_dense_block_count", 0, minimum=0,
                                        maximum=meta.count("block_count")),
        expert_groups=meta.count("expert_group_count", 0, minimum=0) or 1,
        expert_groups_used=meta.count("expert_group_used_count", 0, minimum=0) or 1,
    )


def _check_cache_widths(meta: Metadata, latent: int, rope_dim: int) -> None:
    """attention.key_length and value_length, where written, are the cached row's widths in the
    absorbed form (what llama.cpp sizes its cache by): they must agree with the latent's."""
    for key, width in (("attention.key_length", latent + rope_dim), ("attention.value_length", latent)):
        if meta.has(key) and meta.count(key) != width:
            raise ModelFileError(f"metadata '{meta.arch}.{key}' is {meta.count(key)}, but kv_lora_rank "
                                 f"{latent} and rope dimension {rope_dim} make it {width}")


def _rope_scaling(meta: Metadata) -> RopeScaling:
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
    if not config.has_experts(layer):
        return attention_fields(config, layer) + tm.dense_ffn_fields(config, layer)
    return attention_fields(config, layer) + tm.router_fields(config, layer) + moe_extras(config, layer)


def attention_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    """The latent attention's weights (shapes in GGUF order). attn_k_b and attn_v_b, one matrix per
    head, are vectors: float32 in the pack (a quantized file's take 4 bytes a weight in RAM), used
    by torch's batched matmuls."""
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
    """The selection bias (V3's; V2's files have none) and the ungated shared experts."""
    bias = tm.selection_bias_field(config, layer)
    return ([replace(bias, kind=replace(bias.kind, optional=True))]
            + tm.shared_expert_fields(config, layer, gated=False))


def block(x: Activations, w: Weights, p: LayerPass) -> Activations:
    """x + latent attention(norm(x)), then + ffn(norm(x)): Llama's block around MLA."""
    kernels, eps = p.kernels, p.config.rms_norm_eps
    attended = latent_attention(p, w, kernels.rms_norm(x, w.attn_norm, eps))
    h = kernels.add_rms_norm(x, attended, w.ffn_norm, eps)
    x += (moe_ffn if p.config.has_experts(p.layer_idx) else dense_ffn)(p, w, h, x)
    return x


ARCHITECTURE = Architecture(name="deepseek2", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields,
                            summary="multi-head latent attention (a latent KV cache); leading dense layers; "
                                    "softmax or sigmoid top-k experts with a selection bias; shared experts")
