"""Qwen3 (dense): Llama's block with RMSNorm over each head's query and key (weights of size
head_dim, shared by the heads) before neox rotary, no Q/K/V biases, and a head size of its own
(`attention.key_length`, not hidden / heads: the output projection is [heads * head_dim, hidden])."""

from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import dense_ffn, norm_each_head, pre_norm_block


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    return transformer_config(meta, vocab_size, tied, rope_style="neox")


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return (tm.attention_fields(config, layer) + tm.qk_norm_fields(config, layer, per_head=True)
            + tm.dense_ffn_fields(config, layer))


def block(x, w, p):
    return pre_norm_block(x, w, p, dense_ffn, qk_norm=norm_each_head)


ARCHITECTURE = Architecture(name="qwen3", config=config, layer_fields=layer_fields, block=block,
                            summary="per-head q/k norms; its own head size; rotary over halves")
