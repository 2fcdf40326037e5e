"""GLM-4.5 / 4.6 / 4.7 and 4.5-Air (llama.cpp's glm4moe): the first `leading_dense_block_count`
layers have a dense SwiGLU FFN (`feed_forward_length` wide), the others a mixture of experts
(`expert_count` experts `expert_feed_forward_length` wide, `expert_used_count` per token) plus
`expert_shared_count` shared experts' width of one expert every token uses, not gated. Routing:
sigmoid scores (`expert_gating_func`, sigmoid unless it says softmax), the top k chosen by score +
`exp_probs_b` (a bias that picks, never weighs), their scores rescaled to sum to 1 where
`expert_weights_norm` and multiplied by `expert_weights_scale`. Attention: optional Q/K/V biases,
optional per-head q/k norms, neox rotary over the first `rope.dimension_count` dimensions of each
head (GLM rotates half). The pre-FFN norm is the file's `post_attention_norm`. The last
`nextn_predict_layers` blocks (next-token prediction, counted in `block_count`) are skipped: not
checked, packed or run.
"""

from dataclasses import replace

from tierflow.errors import ModelFileError
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, expert_gating, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import dense_ffn, moe_ffn, norm_each_head, pre_norm_block

PRE_FFN_NORM = "post_attention_norm"


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    base = transformer_config(meta, vocab_size, tied, rope_style="neox", experts="always")
    layers = base.num_layers - meta.count("nextn_predict_layers", 0, minimum=0)
    if layers < 1:
        raise ModelFileError(f"{meta.arch}.nextn_predict_layers must be below block_count "
                             f"{base.num_layers}: no layer would be left to run")
    expert_ffn = meta.count("expert_feed_forward_length")  # llama.cpp requires it
    shared = meta.count("expert_shared_count", minimum=0)
    return replace(base, num_layers=layers, expert_ffn_size=expert_ffn,
                   shared_expert_ffn_size=shared * expert_ffn,
                   leading_dense_layers=meta.count("leading_dense_block_count", 0, minimum=0, maximum=layers),
                   expert_gating=expert_gating(meta, "sigmoid"),
                   expert_weights_norm=meta.flag("expert_weights_norm", False),
                   expert_weights_scale=meta.number("expert_weights_scale", 0.0) or 1.0)


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    attention = (tm.attention_fields(config, layer, bias="optional")
                 + tm.qk_norm_fields(config, layer, per_head=True, optional=True))
    if not config.has_experts(layer):
        return attention + tm.dense_ffn_fields(config, layer, norm=PRE_FFN_NORM)
    shared = tm.shared_expert_fields(config, layer, gated=False) if config.shared_expert_ffn_size else []
    return (attention + tm.router_fields(config, layer, norm=PRE_FFN_NORM)
            + [tm.selection_bias_field(config, layer)] + shared)


def block(x, w, p):
    ffn = moe_ffn if p.config.has_experts(p.layer_idx) else dense_ffn
    return pre_norm_block(x, w, p, ffn, qk_norm=norm_each_head)


ARCHITECTURE = Architecture(name="glm4moe", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields,
                            summary="leading dense layers; sigmoid-scored experts chosen with a bias, "
                                    "normalised and scaled; an ungated shared expert; partial rotary")
