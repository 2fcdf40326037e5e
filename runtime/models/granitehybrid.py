"""IBM Granite 4.0-H and Bamba (llama.cpp's granitehybrid): Mamba-2 layers (mamba2.py) among
attention layers, each followed by an FFN, with Granite's multipliers (llama.cpp's
llm_build_granite_hybrid). A layer is Mamba-2 where `attention.head_count_kv` is 0 for it, attention
otherwise (ssm_hybrid.py). Each block, on x:
    h = x + residual_scale * mixer(attn_norm(x))          (mixer: Mamba-2, or attention)
    x = h + residual_scale * ffn(ffn_norm(h))
The embeddings are multiplied by `embedding_scale`, the attention scores by `attention.scale`, and
the logits divided by `logit_scale` (each 0 or absent: none). Attention rotates adjacent pairs unless
`rope.scaling.finetuned` is false (Granite 4.0-H's files: no rotary). The FFN is SwiGLU, or with
`expert_count` set experts as wide as `feed_forward_length` (softmax top-k, renormalised) and, where
`expert_shared_feed_forward_length` is set, an ungated shared expert.
"""

from dataclasses import replace

import numpy as np

from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights
from tierflow.runtime.models import mamba2, ssm_hybrid
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import attention, dense_ffn, moe_ffn


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    layers = meta.count("block_count")
    kv = ssm_hybrid.per_layer(meta, "attention.head_count_kv", layers)
    types = tuple("attention" if heads else "recurrent" for heads in kv)
    rope_style = "normal" if meta.flag("rope.scaling.finetuned", True) else "none"
    base = ssm_hybrid.hybrid_config(meta, vocab_size, tied, types, rope_style=rope_style, experts="optional")
    shared = meta.count("expert_shared_feed_forward_length", 0, minimum=0) if base.is_moe else 0
    return replace(base, shared_expert_ffn_size=shared, expert_weights_norm=base.is_moe,
                   embedding_scale=meta.number("embedding_scale", 0.0) or 1.0,
                   residual_scale=meta.number("residual_scale", 0.0) or 1.0,
                   logit_scale=meta.number("logit_scale", 0.0) or 1.0,
                   attention_scale=meta.number("attention.scale", 0.0))


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    if config.is_recurrent(layer):
        mixer = mamba2.layer_fields(config, layer)
    else:
        mixer = tm.attention_fields(config, layer, bias="optional", output_bias="optional")
    if not config.is_moe:
        return mixer + tm.dense_ffn_fields(config, layer)
    shared = tm.shared_expert_fields(config, layer, gated=False) if config.shared_expert_ffn_size else []
    return mixer + tm.router_fields(config, layer) + shared


def block(x: Activations, w: Weights, p: LayerPass) -> Activations:
    cfg, kernels = p.config, p.kernels
    h = kernels.rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
    mixed = kernels.take(mamba2.mixer(p, w, h) if cfg.is_recurrent(p.layer_idx) else attention(p, w, h))
    h = kernels.add_rms_norm(x, _scaled(mixed, cfg.residual_scale), w.ffn_norm, cfg.rms_norm_eps)
    ffn = moe_ffn if cfg.is_moe else dense_ffn
    x += _scaled(ffn(p, w, h, x), cfg.residual_scale)
    return x


def _scaled(x: Activations, scale: float) -> Activations:
    """x * scale in float32, as ggml_scale (x itself for 1)."""
    return x if scale == 1.0 else x * float(np.float32(scale))


ARCHITECTURE = Architecture(name="granitehybrid", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields, layer_kind=ssm_hybrid.layer_kind,
                            summary="Mamba-2 layers among attention layers (head_count_kv 0), each with an "
                                    "FFN or experts and an ungated shared expert; Granite's embedding, "
                                    "residual, attention and logit multipliers")
