"""Llama (Llama 2 and 3, Mistral, SmolLM2) and Mixtral, its mixture-of-experts form.

Pre-norm blocks of grouped-query attention and a SwiGLU FFN; rotary over adjacent pairs
(llama.cpp's "normal" rope); biases on Q/K/V used when the file has them; Llama 3's
per-frequency rope factors as the optional `rope_freqs.weight`. With `llama.expert_count` set
(Mixtral), each layer's FFN is that many experts as wide as `feed_forward_length`, of which each
token uses the top `expert_used_count` by softmax, their weights rescaled to sum to 1.
"""

from dataclasses import replace

from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import dense_ffn, moe_ffn, pre_norm_block


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    base = transformer_config(meta, vocab_size, tied, rope_style="normal", experts="optional")
    return replace(base, expert_weights_norm=base.is_moe)


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    ffn = tm.router_fields(config, layer) if config.is_moe else tm.dense_ffn_fields(config, layer)
    return tm.attention_fields(config, layer, bias="optional") + ffn


def block(x, w, p):
    return pre_norm_block(x, w, p, moe_ffn if p.config.is_moe else dense_ffn)


ARCHITECTURE = Architecture(
    name="llama", config=config, layer_fields=layer_fields, block=block, expert_fields=tm.expert_fields,
    global_fields=lambda c: tm.global_fields(c, rope_freqs=True),
    summary="rotary over adjacent pairs; Mixtral-style experts when expert_count is set")
