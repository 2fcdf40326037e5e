"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (Q/K/V biases, neox rotary) with a
mixture of experts in every layer: the top `expert_used_count` of `expert_count` experts by
softmax, weighted by their raw probabilities (not rescaled), each `expert_feed_forward_length`
wide, plus a shared expert every token uses (`expert_shared_feed_forward_length` wide, or
`feed_forward_length` without the key) scaled by sigmoid(h @ ffn_gate_inp_shexp)."""

from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import moe_ffn, pre_norm_block


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    return transformer_config(meta, vocab_size, tied, rope_style="neox", experts="always",
                              expert_ffn_key=True, shared_expert=True)


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return (tm.attention_fields(config, layer, bias="required") + tm.router_fields(config, layer)
            + tm.shared_expert_fields(config, layer))


def block(x, w, p):
    return pre_norm_block(x, w, p, moe_ffn)


ARCHITECTURE = Architecture(name="qwen2moe", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields,
                            summary="Q/K/V biases; softmax top-k experts, not renormalised; "
                                    "a gated shared expert")
