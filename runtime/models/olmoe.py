"""OLMoE: a mixture of experts in every layer (the top `expert_used_count` by softmax, weighted by
their raw probabilities, each `feed_forward_length` wide) and RMSNorm over all of the queries and
all of the keys (weights as wide as the projections) before neox rotary."""

from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import moe_ffn, norm_whole_projections, pre_norm_block


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    return transformer_config(meta, vocab_size, tied, rope_style="neox", experts="always")


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return (tm.attention_fields(config, layer) + tm.qk_norm_fields(config, layer, per_head=False)
            + tm.router_fields(config, layer))


def block(x, w, p):
    return pre_norm_block(x, w, p, moe_ffn, qk_norm=norm_whole_projections)


ARCHITECTURE = Architecture(name="olmoe", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields,
                            summary="q/k norms over whole projections; softmax top-k experts, "
                                    "not renormalised")
