"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B): Qwen3's attention (per-head q/k
norms, neox rotary, its own head size, no biases) with a mixture of experts in every layer: the
top `expert_used_count` of `expert_count` experts by softmax, their weights rescaled to sum to 1,
each `expert_feed_forward_length` wide (llama.cpp's default without the key: feed_forward_length /
expert_used_count), and no shared expert."""

from dataclasses import replace

from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import moe_ffn, norm_each_head, pre_norm_block


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    base = transformer_config(meta, vocab_size, tied, rope_style="neox", experts="always",
                              expert_ffn_key=True)
    return replace(base, expert_weights_norm=True)


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return (tm.attention_fields(config, layer) + tm.qk_norm_fields(config, layer, per_head=True)
            + tm.router_fields(config, layer))


def block(x, w, p):
    return pre_norm_block(x, w, p, moe_ffn, qk_norm=norm_each_head)


ARCHITECTURE = Architecture(name="qwen3moe", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields,
                            summary="per-head q/k norms; softmax top-k experts, renormalised; "
                                    "no shared expert")
