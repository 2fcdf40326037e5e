"""AI21's Jamba (llama.cpp's jamba): Mamba-1 layers (mamba.py, with RMS norms of dt, B and C) and,
every few layers, attention without rotary, told apart by the per-layer `attention.head_count_kv` (0:
Mamba); each layer's FFN is a SwiGLU or, where the file has the layer's router
(`blk.N.ffn_gate_inp.weight`, as llama.cpp tells them), experts routed by a softmax over every
expert, the chosen weights used as they are. Each block:
    h = x + mixer(attn_norm(x))
    x = h + ffn(ffn_norm(h))
The experts are `feed_forward_length` wide, as the dense FFNs are.
"""

from dataclasses import replace
from functools import partial

from tierflow.errors import ModelFileError
from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights
from tierflow.runtime.models import mamba, ssm_hybrid
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import dense_ffn, moe_ffn, pre_norm_block


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    layers = meta.count("block_count")
    for layer, width in enumerate(ssm_hybrid.per_layer(meta, "feed_forward_length", layers)):
        if not width:
            raise ModelFileError(f"layer {layer} has no FFN ({meta.arch}.feed_forward_length 0): every "
                                 f"{meta.arch} layer, Mamba or attention, has an FFN or experts")
    kv = ssm_hybrid.per_layer(meta, "attention.head_count_kv", layers)
    types = tuple("attention" if heads else "recurrent" for heads in kv)
    base = ssm_hybrid.hybrid_config(meta, vocab_size, tied, types, shape=mamba.scan_shape(meta),
                                    rope_style="none", experts="always")
    routed = tuple(meta.has_tensor(f"blk.{layer}.ffn_gate_inp.weight") for layer in range(layers))
    return replace(base, ssm_time_step_rank=meta.count("ssm.time_step_rank"), expert_layers=routed)


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    if config.is_recurrent(layer):
        mixer = mamba.layer_fields(config, layer, normed=True)
    else:
        mixer = tm.attention_fields(config, layer)
    ffn = tm.router_fields if config.has_experts(layer) else tm.dense_ffn_fields
    return mixer + ffn(config, layer)


def layer_kind(config: ModelConfig, layer: int) -> str:
    """What the metadata and the router's presence make of a layer, for a file whose tensors say otherwise."""
    mixer = "a Mamba layer" if config.is_recurrent(layer) else "an attention layer"
    ffn = ("with experts (the file has its ffn_gate_inp.weight)" if config.has_experts(layer)
           else "with a dense FFN (the file has no ffn_gate_inp.weight for it)")
    return f"layer {layer} is {mixer} by the metadata's per-layer attention.head_count_kv, {ffn}"


def block(x: Activations, w: Weights, p: LayerPass) -> Activations:
    cfg, layer = p.config, p.layer_idx
    return pre_norm_block(x, w, p, moe_ffn if cfg.has_experts(layer) else dense_ffn,
                          mixer=_normed_mixer if cfg.is_recurrent(layer) else None)


_normed_mixer = partial(mamba.mixer, normed=True)


ARCHITECTURE = Architecture(name="jamba", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=tm.expert_fields, layer_kind=layer_kind,
                            summary="Mamba-1 layers (dt, B and C normed) among attention layers without "
                                    "rotary (head_count_kv 0: Mamba), each with a SwiGLU FFN or, where "
                                    "the layer has a router, softmax-routed experts")
