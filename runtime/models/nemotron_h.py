"""NVIDIA Nemotron-H (llama.cpp's nemotron_h): each layer one of three kinds, told by its per-layer
counts (ssm_hybrid.py): Mamba-2 (mamba2.py; `attention.head_count_kv` and `feed_forward_length` both
0), attention without rotary (head_count_kv alone set) or an FFN (feed_forward_length alone set),
whose up-projection is squared after a ReLU and which has no gate. Each block is
x += mixer(attn_norm(x)), with the layer's mixer and its one norm; no norm mixes the kinds. The
attention's and the FFN's biases are used where the file has them.
"""

import torch

from tierflow.errors import ModelFileError
from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights
from tierflow.runtime.models import mamba2, ssm_hybrid
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import attention


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    layers = meta.count("block_count")
    kv = ssm_hybrid.per_layer(meta, "attention.head_count_kv", layers)
    ffn = ssm_hybrid.per_layer(meta, "feed_forward_length", layers)
    types = tuple(_layer_type(meta, i, heads, width) for i, (heads, width) in enumerate(zip(kv, ffn)))
    return ssm_hybrid.hybrid_config(meta, vocab_size, tied, types, rope_style="none")


def _layer_type(meta: Metadata, layer: int, kv_heads: int, ffn_width: int) -> str:
    if kv_heads and ffn_width:
        raise ModelFileError(f"layer {layer} has both attention heads ({meta.arch}.attention.head_count_kv "
                             f"{kv_heads}) and an FFN ({meta.arch}.feed_forward_length {ffn_width}): a "
                             f"{meta.arch} layer is Mamba-2 (neither), attention or an FFN")
    return "attention" if kv_heads else "ffn" if ffn_width else "recurrent"


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    kind = config.layer_types[layer]
    if kind == "recurrent":
        return mamba2.layer_fields(config, layer)
    if kind == "attention":
        return tm.attention_fields(config, layer, bias="optional", output_bias="optional")
    e, f, p = config.hidden_size, config.ffn_size, f"blk.{layer}."
    return [tm.vector("attn_norm", p + "attn_norm.weight", (e,), "ffn"),
            tm.matmul("up", [(p + "ffn_up.weight", (e, f))], "ffn", bias="optional"),
            tm.matmul("down", [(p + "ffn_down.weight", (f, e))], "ffn", bias="optional")]


def relu_squared_ffn(p: LayerPass, w: Weights, h: Activations) -> Activations:
    """down(relu(up h)^2), [T, E] -> [T, E]."""
    up = torch.relu(torch.as_tensor(w.up(h)))
    return w.down(p.kernels.take(up * up))


MIXERS = {"recurrent": mamba2.mixer, "attention": attention, "ffn": relu_squared_ffn}


def block(x: Activations, w: Weights, p: LayerPass) -> Activations:
    h = p.kernels.rms_norm(x, w.attn_norm, p.config.rms_norm_eps)
    x += p.kernels.take(MIXERS[p.config.layer_types[p.layer_idx]](p, w, h))
    return x


ARCHITECTURE = Architecture(name="nemotron_h", config=config, layer_fields=layer_fields, block=block,
                            layer_kind=ssm_hybrid.layer_kind,
                            summary="each layer Mamba-2, attention without rotary, or a squared-ReLU FFN")
