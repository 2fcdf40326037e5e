"""TII's Falcon-H1 (llama.cpp's falcon-h1): in every layer attention and a Mamba-2 mixer (mamba2.py)
side by side on the same normed input, their outputs summed, then a SwiGLU FFN:
    h = x + attention(attn_norm(x)) + mamba2(attn_norm(x))
    x = h + ffn(ffn_norm(h))
Attention rotates the two halves (neox); its output projection's bias, which llama.cpp does not add,
is not read. Falcon-H1's multipliers (the embeddings', the attention's
and the Mamba-2 mixer's inputs and outputs, the FFN's, the head's) are folded into the weights by
llama.cpp's converter, so a file computes with none. A layer keeps both kinds of memory
(kinds.RowsAndState); the mixer's grouped norm is used where the file has it (`ssm_norm`). The
FFN's norm is `blk.N.ffn_norm`, without `.weight`, as the converter names it."""

from dataclasses import replace

from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights
from tierflow.runtime.memory.kinds import RowsAndState
from tierflow.runtime.models import mamba2
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import attention, dense_ffn


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    base = transformer_config(meta, vocab_size, tied, rope_style="neox")
    base = replace(base, recurrent=mamba2.scan_shape(meta))
    return replace(base, layer_kinds=(RowsAndState(base.recurrent, base.cache_rows),) * base.num_layers)


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    mixer = [f for f in mamba2.layer_fields(config, layer, norm_optional=True) if f.name != "attn_norm"]
    ffn = [f for f in tm.dense_ffn_fields(config, layer) if f.name != "ffn_norm"]
    norm = tm.vector("ffn_norm", f"blk.{layer}.ffn_norm", (config.hidden_size,), "ffn")  # no ".weight"
    return tm.attention_fields(config, layer, bias="optional") + mixer + [norm] + ffn


def block(x: Activations, w: Weights, p: LayerPass) -> Activations:
    kernels, eps = p.kernels, p.config.rms_norm_eps
    h = kernels.rms_norm(x, w.attn_norm, eps)
    both = kernels.take(attention(p, w, h)) + kernels.take(mamba2.mixer(p, w, h))  # llama.cpp's order
    h = kernels.add_rms_norm(x, both, w.ffn_norm, eps)
    x += dense_ffn(p, w, h, x)
    return x


ARCHITECTURE = Architecture(name="falcon-h1", config=config, layer_fields=layer_fields, block=block,
                            summary="attention and a Mamba-2 mixer side by side in every layer, their "
                                    "outputs summed; a SwiGLU FFN")
