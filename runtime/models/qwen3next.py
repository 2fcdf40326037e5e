"""Qwen3-Next (Qwen3-Next-80B-A3B; llama.cpp's qwen3next): the hybrid linear-attention decoder of
delta_net.py with qwen35moe's mixture of experts (softmax top-k renormalised, a sigmoid-gated shared
expert) and plain neox rotary. Its DeltaNet layers project jointly, grouped by key head: `ssm_in`
holds, for each key head, its query, its key, then the values and the gates of the value heads that
share it; `ssm_ba` holds, for each key head, those value heads' betas then their alphas. A value
head reads the key head of its group (h // shared)."""

from dataclasses import replace
from functools import partial

import torch

from tierflow.runtime.memory.state_shapes import RecurrentShape
from tierflow.runtime.models import delta_net
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture, transformer_config
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import moe_ffn
from tierflow.runtime.models.qwen35moe import ffn_fields


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    base = transformer_config(meta, vocab_size, tied, rope_style="neox", experts="always",
                              expert_ffn_key=True, shared_expert=True)
    return delta_net.hybrid_config(meta, replace(base, expert_weights_norm=True))


def _joint_tensors(config: ModelConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    e, s, p = config.hidden_size, config.recurrent, f"blk.{layer}."
    values = s.value_heads * s.value_dim
    return [(p + "ssm_in.weight", (e, 2 * s.key_heads * s.key_dim + 2 * values)),
            (p + "ssm_ba.weight", (e, 2 * s.value_heads))]


def _unpack_joint(s: RecurrentShape, projected: torch.Tensor) -> delta_net.Unpacked:
    """[q, k, v, z] and [beta, alpha] per key head -> the convolution's input [all q, all k, all v],
    the gates, betas and alphas in value-head order."""
    tokens, shared = projected.shape[0], s.value_heads // s.key_heads
    grouped = shared * s.value_dim
    qkvz, ba = projected.split([2 * s.key_heads * (s.key_dim + grouped), 2 * s.value_heads], dim=-1)
    q, k, v, z = qkvz.reshape(tokens, s.key_heads, -1).split([s.key_dim, s.key_dim, grouped, grouped], dim=-1)
    beta, alpha = ba.reshape(tokens, s.key_heads, 2 * shared).split([shared, shared], dim=-1)
    conv_in = torch.cat([x.reshape(tokens, -1) for x in (q, k, v)], dim=-1)
    return conv_in, z.reshape(tokens, -1), beta.reshape(tokens, -1), alpha.reshape(tokens, -1)


JOINT = delta_net.LinearLayout(_joint_tensors, _unpack_joint, interleaved_heads=True)


def layer_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    return delta_net.layer_fields(config, layer, ffn_fields, JOINT)


ARCHITECTURE = Architecture(name="qwen3next", config=config, layer_fields=layer_fields,
                            block=partial(delta_net.block, ffn=moe_ffn, layout=JOINT),
                            expert_fields=tm.expert_fields, layer_kind=delta_net.layer_kind,
                            mtp_fields=partial(delta_net.mtp_fields, ffn=ffn_fields),
                            summary=f"{delta_net.SUMMARY}; projections grouped by key head; softmax top-k "
                                    f"experts, renormalised, and a gated shared expert")
