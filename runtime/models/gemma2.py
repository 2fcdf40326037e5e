"""Gemma 2: a sandwich-norm block (each of attention and FFN between two RMSNorms, four per block,
their weights stored as 1 + w already), GeGLU with the tanh GELU, embeddings scaled by
sqrt(hidden), neox rotary, a sliding window (`attention.sliding_window`, default 4096) on every
other layer (llama.cpp's pattern: layer i is local when i % period < period - 1, the period 2
unless `attention.sliding_window_pattern` says otherwise), and soft caps on the attention scores
and the logits, defaulting to 50 and 30 as llama.cpp does where the keys are missing. The output
head is the embeddings. The queries' scale is llama.cpp's, from the model's size: it reads no
`attention.scale` for Gemma.

The helpers below are Gemma's, shared with gemma3.py.
"""

from dataclasses import replace

import numpy as np

from tierflow.errors import UnsupportedModelError
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import geglu_ffn, sandwich_norm_block

DEFAULT_WINDOW = 4096  # llama.cpp's for files without attention.sliding_window
LOCAL_PERIOD = 2  # of every 2 layers, the first is local
LAYERS_OF_27B = 46  # the one size whose attention scale is hidden / heads rather than head_dim


def gemma_config(meta: Metadata, vocab_size: int, tied: bool, window: int, period: int,
                 layers_of_27b: int) -> ModelConfig:
    """What Gemma 2 and 3 share: the transformer's keys, neox rotary, embeddings scaled by
    sqrt(hidden) (llama.cpp's sqrtf, a float32), the layers' windows and the query scale."""
    base = transformer_config(meta, vocab_size, tied, rope_style="neox")
    period = meta.count("attention.sliding_window_pattern", period, minimum=0)
    return replace(base, layer_windows=sliding_windows(base.num_layers, window, period),
                   embedding_scale=float(np.sqrt(np.float32(base.hidden_size))),
                   attention_scale=attention_scale(base, layers_of_27b))


def sliding_windows(num_layers: int, window: int, period: int) -> tuple[int, ...]:
    """Each layer's window: `window` on the first period - 1 layers of every period, 0 (the whole
    context) on the last; on every layer for period 0 (llama.cpp's set_swa_pattern); none at all
    for window 0."""
    if not window:
        return ()
    return tuple(window if not period or layer % period < period - 1 else 0 for layer in range(num_layers))


def attention_scale(config: ModelConfig, layers_of_27b: int) -> float:
    """The queries' scale, as llama.cpp derives it from the model's size (no key holds it):
    1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 27B, in float32."""
    width = config.head_dim
    if config.num_layers == layers_of_27b:
        width = config.hidden_size // config.num_heads
    return float(np.float32(1) / np.sqrt(np.float32(width)))


def post_norm_fields(config: ModelConfig, layer: int) -> tuple[tm.Field, tm.Field]:
    """The norms of the attention's and the FFN's outputs."""
    e, p = config.hidden_size, f"blk.{layer}."
    return (tm.vector("attn_post_norm", p + "post_attention_norm.weight", (e,), "attention"),
            tm.vector("ffn_post_norm", p + "post_ffw_norm.weight", (e,), "ffn"))


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    window = meta.count("attention.sliding_window", DEFAULT_WINDOW, minimum=0)
    base = gemma_config(meta, vocab_size, tied, window, LOCAL_PERIOD, LAYERS_OF_27B)
    return replace(base, sliding_rope_theta=_local_rope_theta(meta, base),
                   attn_logit_softcap=meta.number("attn_logit_softcapping", 50.0),
                   final_logit_softcap=meta.number("final_logit_softcapping", 30.0))


def _local_rope_theta(meta: Metadata, config: ModelConfig) -> float:
    """`rope.freq_base_swa`, the local layers' rotary base, where a file sets one (no Gemma 2
    does); 0 (as the global layers) otherwise. llama.cpp scales those layers' rotary as the
    global ones' and tierflow leaves them unscaled (Gemma 3's rule), so a file with both that key
    and rope scaling is refused rather than computed differently."""
    if not meta.has("rope.freq_base_swa"):
        return 0.0
    if config.rope_scaling.kind != "none":
        raise UnsupportedModelError(f"{meta.arch}: rope.freq_base_swa together with rope scaling is "
                                    "not supported")
    return meta.number("rope.freq_base_swa")


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    attn_post_norm, ffn_post_norm = post_norm_fields(config, layer)
    return (tm.attention_fields(config, layer) + [attn_post_norm] + tm.dense_ffn_fields(config, layer)
            + [ffn_post_norm])


def block(x, w, p):
    return sandwich_norm_block(x, w, p, geglu_ffn)


ARCHITECTURE = Architecture(name="gemma2", config=config, layer_fields=layer_fields, block=block,
                            summary="sandwich norms, GeGLU, every other layer local, soft-capped scores")
