"""Qwen3.5 / 3.6 MoE (Qwen3.5-35B-A3B; llama.cpp's qwen35moe): the hybrid linear-attention decoder
of delta_net.py with a mixture of experts in every layer: the top `expert_used_count` of
`expert_count` experts by softmax, their weights rescaled to sum to 1, each
`expert_feed_forward_length` wide, plus a shared expert (`expert_shared_feed_forward_length`)
scaled by sigmoid(x @ ffn_gate_inp_shexp). The trailing multi-token-prediction block is not part of
the model: `draft="mtp"` runs it (delta_net.mtp_fields)."""

from dataclasses import replace
from functools import partial

from tierflow.runtime.models import delta_net
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import moe_ffn


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    base = transformer_config(meta, vocab_size, tied, rope_style="neox", experts="always",
                              expert_ffn_key=True, shared_expert=True)
    return delta_net.hybrid_config(meta, replace(base, expert_weights_norm=True))


def ffn_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return (tm.router_fields(config, layer, norm=delta_net.PRE_FFN_NORM)
            + tm.shared_expert_fields(config, layer))


ARCHITECTURE = Architecture(name="qwen35moe", config=config,
                            layer_fields=partial(delta_net.layer_fields, ffn=ffn_fields),
                            block=partial(delta_net.block, ffn=moe_ffn), expert_fields=tm.expert_fields,
                            layer_kind=delta_net.layer_kind,
                            mtp_fields=partial(delta_net.mtp_fields, ffn=ffn_fields),
                            summary=f"{delta_net.SUMMARY}; softmax top-k experts, renormalised, and a "
                                    f"gated shared expert")
