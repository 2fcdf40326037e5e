"""Gemma 3 (text): Gemma 2's block (gemma2.py) with RMSNorm over each head's query and key
(weights of size head_dim) before rotary, and no cap on the attention scores. Five of every six
layers are local (the period 6 unless `attention.sliding_window_pattern` says otherwise: layer i
local when i % 6 < 5) with the window of `attention.sliding_window` (none without it) and a
rotary base of their own (`rope.freq_base_swa`, default 10000), unscaled; the global layers
rotate with `rope.freq_base` and the file's rope scaling. Logits are soft-capped only where
`final_logit_softcapping` is set.
"""

from dataclasses import replace

from tierflow.runtime.models import gemma2
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import geglu_ffn, norm_each_head, sandwich_norm_block

LOCAL_PERIOD = 6  # of every 6 layers, the first 5 are local
LOCAL_ROPE_THETA = 10000.0
LAYERS_OF_27B = 62


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    window = meta.count("attention.sliding_window", 0, minimum=0)
    base = gemma2.gemma_config(meta, vocab_size, tied, window, LOCAL_PERIOD, LAYERS_OF_27B)
    local_theta = meta.number("rope.freq_base_swa", LOCAL_ROPE_THETA) if window else 0.0
    return replace(base, sliding_rope_theta=local_theta,
                   final_logit_softcap=meta.number("final_logit_softcapping", 0.0))


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    attn_post_norm, ffn_post_norm = gemma2.post_norm_fields(config, layer)
    return (tm.attention_fields(config, layer) + tm.qk_norm_fields(config, layer, per_head=True)
            + [attn_post_norm] + tm.dense_ffn_fields(config, layer) + [ffn_post_norm])


def block(x, w, p):
    return sandwich_norm_block(x, w, p, geglu_ffn, qk_norm=norm_each_head)


ARCHITECTURE = Architecture(name="gemma3", config=config, layer_fields=layer_fields, block=block,
                            summary="Gemma 2's block with per-head q/k norms; 5 of 6 layers local")
