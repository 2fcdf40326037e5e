"""Qwen2 (and Qwen2.5): Llama's block with biases on Q, K and V and rotary over the two halves of
each head (llama.cpp's "neox" rope)."""

from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import dense_ffn, pre_norm_block


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    return transformer_config(meta, vocab_size, tied, rope_style="neox")


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return tm.attention_fields(config, layer, bias="required") + tm.dense_ffn_fields(config, layer)


def block(x, w, p):
    return pre_norm_block(x, w, p, dense_ffn)


ARCHITECTURE = Architecture(name="qwen2", config=config, layer_fields=layer_fields, block=block,
                            summary="Q/K/V biases; rotary over halves")
