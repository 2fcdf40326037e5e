"""Qwen3.5 / 3.6 dense (llama.cpp's qwen35): the hybrid linear-attention decoder of delta_net.py
with a SwiGLU FFN in every layer. The trailing multi-token-prediction block (`nextn_predict_layers`,
counted in `block_count`) is not part of the model: `draft="mtp"` runs it (delta_net.mtp_fields)."""

from functools import partial

from tierflow.runtime.models import delta_net
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import dense_ffn


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    return delta_net.hybrid_config(meta, transformer_config(meta, vocab_size, tied, rope_style="neox"))


def ffn_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return tm.dense_ffn_fields(config, layer, norm=delta_net.PRE_FFN_NORM)


ARCHITECTURE = Architecture(name="qwen35", config=config,
                            layer_fields=partial(delta_net.layer_fields, ffn=ffn_fields),
                            block=partial(delta_net.block, ffn=dense_ffn), layer_kind=delta_net.layer_kind,
                            mtp_fields=partial(delta_net.mtp_fields, ffn=ffn_fields),
                            summary=f"{delta_net.SUMMARY}; a SwiGLU FFN")
