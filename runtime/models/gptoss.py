"""gpt-oss (gpt-oss-20b, gpt-oss-120b; llama.cpp's LLM_ARCH_OPENAI_MOE, "gpt-oss" in the file).

Pre-norm blocks whose attention has biases on Q, K, V and the output projection, an attention
sink per query head (`attn_sinks`, one more logit in each head's softmax, which takes probability
and adds no value), neox rotary (YaRN as the file's rope scaling says) and a sliding window of
`attention.sliding_window` positions on every other layer (llama.cpp's swa pattern 2: the even
layers are local, the odd ones see the whole context). The pre-FFN norm is the tensor llama.cpp
calls attn_post_norm (`post_attention_norm`). Every layer is a mixture of experts: the top
`expert_used_count` experts by the router's raw logits (with its bias), weighted by the softmax
of those k logits; each expert, `expert_feed_forward_length` wide with biases on gate, up and
down, computes the clamped SwiGLU (layers.clamped_swiglu_experts). The output head is its own tensor.
"""

from dataclasses import replace
from functools import partial

from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.gemma2 import sliding_windows
from tierflow.runtime.models.layers import clamped_swiglu_experts, moe_ffn, pre_norm_block

LOCAL_PERIOD = 2  # of every 2 layers, the first is local


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    base = transformer_config(meta, vocab_size, tied, rope_style="neox", experts="always",
                              expert_ffn_key=True)
    window = meta.count("attention.sliding_window", maximum=1 << 40)
    return replace(base, layer_windows=sliding_windows(base.num_layers, window, LOCAL_PERIOD),
                   expert_gating="softmax_weight")


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    e, h, n, p = config.hidden_size, config.num_heads, config.num_experts, f"blk.{layer}."
    return tm.attention_fields(config, layer, bias="required", output_bias="required") + [
        tm.vector("attn_sinks", p + "attn_sinks.weight", (h,), "attention"),
        tm.vector("ffn_norm", p + "post_attention_norm.weight", (e,), "router"),
        tm.matmul("router", [(p + "ffn_gate_inp.weight", (e, n))], "router", bias="required",
                  requantize=False)]


_ffn = partial(moe_ffn, expert_ffn=clamped_swiglu_experts)


def block(x, w, p):
    return pre_norm_block(x, w, p, _ffn)


ARCHITECTURE = Architecture(name="gpt-oss", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=partial(tm.expert_fields, bias="required"),
                            summary="attention sinks; every other layer local; biases everywhere; "
                                    "softmax over the top-k router logits; clamped SwiGLU experts")
