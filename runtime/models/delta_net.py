"""The hybrid linear-attention decoder of Qwen3-Next and Qwen3.5 (llama.cpp's qwen3next, qwen35,
qwen35moe): three of every `full_attention_interval` layers are Gated DeltaNet linear attention, the
last one full attention.

A DeltaNet layer (llama.cpp's build_layer_attn_linear), on the normed input x:
    qkv = x @ attn_qkv, z = x @ attn_gate, beta = sigmoid(x @ ssm_beta),
    g = softplus(x @ ssm_alpha + ssm_dt.bias) * ssm_a          (ssm_a < 0: a decay)
    q, k, v = split(silu(causal_conv(qkv, ssm_conv1d)))         (q, k L2-normed per head)
    o = gated delta rule over the layer's recurrent state (runtime/compute/delta_rule.py)
    out = (rms_norm(o per head) * ssm_norm * silu(z)) @ ssm_out
Queries and keys have `ssm.group_count` heads of `ssm.state_size`, values `ssm.time_step_rank`
heads of `ssm.inner_size / ssm.time_step_rank`; value head h reads query/key head h % group_count
(ggml_repeat's tiling; Qwen3-Next's h // shared). The state lives in the cache
(runtime/memory/recurrent_state.py), not in here. How the input projections are laid out is the family's
LinearLayout: Qwen3.5 has a tensor for each part, Qwen3-Next one for q, k, v and z and one for beta and
alpha, each interleaved by key head.
A full-attention layer projects queries and a gate jointly (`attn_q`, per head the query then
the gate), norms each head's query and key, rotates the first `rope.dimension_count` dimensions
(multi-section rotary: text positions are the same in every section, so it is neox rotary) and
multiplies the attention's output by sigmoid(gate) before `attn_output`. Each block is
x += mixer(attn_norm(x)); x += ffn(post_attention_norm(x)).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.compute import delta_rule
from tierflow.runtime.compute.delta_rule import same_bits
from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights, stack_rows
from tierflow.runtime.memory.recurrent_state import Recurrence, Steps
from tierflow.runtime.memory.state_shapes import RecurrentShape
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import FFN, attend, norm_each_head, pre_norm_block

PRE_FFN_NORM = "post_attention_norm"
SUMMARY = "Gated DeltaNet linear attention with a recurrent state in 3 of 4 layers, gated full attention"


def hybrid_config(meta: Metadata, base: ModelConfig) -> ModelConfig:
    """The recurrent layers and their state's shape, from the ssm.* keys and the interval."""
    shape = RecurrentShape(conv_kernel=meta.count("ssm.conv_kernel", minimum=2, maximum=64),
                           key_heads=meta.count("ssm.group_count"),
                           value_heads=meta.count("ssm.time_step_rank"),
                           key_dim=meta.count("ssm.state_size"), value_dim=1)
    inner = meta.count("ssm.inner_size")
    if inner % shape.value_heads or inner // shape.value_heads != shape.key_dim:
        raise UnsupportedModelError(f"{meta.arch}.ssm.inner_size {inner} is not ssm.time_step_rank "
                                    f"{shape.value_heads} heads of ssm.state_size {shape.key_dim}: "
                                    f"tierflow computes value heads as wide as key heads")
    if shape.value_heads % shape.key_heads:
        raise ModelFileError(f"{meta.arch}.ssm.time_step_rank {shape.value_heads} (value heads) is not a "
                             f"multiple of ssm.group_count {shape.key_heads} (key heads)")
    interval = meta.count("full_attention_interval", 4)
    nextn = meta.count("nextn_predict_layers", 0, minimum=0)
    layers = base.num_layers - nextn
    if layers < 1:
        raise ModelFileError(f"{meta.arch}.nextn_predict_layers must be below block_count "
                             f"{base.num_layers}: no layer would be left to run")
    _check_rope_sections(meta, base.rope_dim)
    return replace(base, num_layers=layers, recurrent=replace(shape, value_dim=shape.key_dim),
                   recurrent_layers=tuple((i + 1) % interval != 0 for i in range(layers)), nextn_layers=nextn)


def _check_rope_sections(meta: Metadata, rope_dim: int) -> None:
    """Interleaved multi-section rotary (llama.cpp's imrope) turns rotary pair i by the position's
    component i % 3 (time, height, width: a text token's position in each) while i // 3 is below
    that component's section, and by its fourth component (0 for text) otherwise: text rotates as
    neox rotary only when the first three sections cover every pair."""
    key = f"{meta.arch}.rope.dimension_sections"
    sections = meta.metadata.get(key)
    if sections is None:
        return
    if not isinstance(sections, (list, tuple, np.ndarray)) or len(sections) != 4 \
            or any(not isinstance(s, (int, np.integer)) or s < 0 for s in sections):
        shown = list(sections)[:8] if isinstance(sections, (list, tuple, np.ndarray)) else repr(sections)[:40]
        raise ModelFileError(f"metadata '{key}' must be an array of 4 counts >= 0, got {shown}")
    period = int(sum(sections))
    uncovered = [pair for pair in range(rope_dim // 2)
                 if not period or pair % period // 3 >= sections[pair % period % 3]]
    if uncovered:
        raise UnsupportedModelError(f"metadata '{key}' is {[int(s) for s in sections]}: rotary pairs "
                                    f"{uncovered} of {rope_dim // 2} would turn by a fourth position "
                                    f"component, which tierflow does not compute for text")


Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # conv_in, z, beta, alpha


@dataclass(frozen=True)
class LinearLayout:
    """How a family lays out a DeltaNet layer's input projections (the field `ssm_in`, one linear)
    and shares its key heads among the value heads."""

    tensors: Callable[[ModelConfig, int], list[tuple[str, tuple[int, ...]]]]  # ssm_in's tensors
    unpack: Callable[[RecurrentShape, torch.Tensor], Unpacked]  # ssm_in's output [T, ...] -> its parts
    interleaved_heads: bool  # value head h reads key head h // (value / key heads), else h % key heads


def _separate_tensors(config: ModelConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    e, s, p = config.hidden_size, config.recurrent, f"blk.{layer}."
    values = s.value_heads * s.value_dim
    return [(p + "attn_qkv.weight", (e, s.conv_channels)), (p + "attn_gate.weight", (e, values)),
            (p + "ssm_beta.weight", (e, s.value_heads)), (p + "ssm_alpha.weight", (e, s.value_heads))]


def _unpack_separate(s: RecurrentShape, projected: torch.Tensor) -> Unpacked:
    values = s.value_heads * s.value_dim
    return projected.split([s.conv_channels, values, s.value_heads, s.value_heads], dim=-1)


# Qwen3.5's: the convolution's input, the gate, beta and alpha each a tensor of its own
SEPARATE = LinearLayout(_separate_tensors, _unpack_separate, interleaved_heads=False)


def layer_fields(config: ModelConfig, layer: int, ffn: Callable[[ModelConfig, int], list[tm.Field]],
                 layout: LinearLayout = SEPARATE) -> list[tm.Field]:
    """A layer's mixer (linear or full attention) and its FFN's fields (`ffn`'s, whose norm is the
    file's post_attention_norm)."""
    if config.is_recurrent(layer):
        return linear_attention_fields(config, layer, layout) + ffn(config, layer)
    return gated_attention_fields(config, layer) + ffn(config, layer)


def mtp_fields(config: ModelConfig, ffn: Callable[[ModelConfig, int], list[tm.Field]]) -> list[tm.Field]:
    """The multi-token-prediction block after the last layer: a full-attention layer (llama.cpp's
    graph_mtp) with the family's FFN, and its nextn fields."""
    layer = config.num_layers
    return gated_attention_fields(config, layer) + ffn(config, layer) + tm.nextn_fields(config, layer)


def linear_attention_fields(config: ModelConfig, layer: int, layout: LinearLayout) -> list[tm.Field]:
    e, s, p = config.hidden_size, config.recurrent, f"blk.{layer}."
    values = s.value_heads * s.value_dim
    return [tm.vector("attn_norm", p + "attn_norm.weight", (e,), "attention"),
            tm.matmul("ssm_in", layout.tensors(config, layer), "attention"),
            tm.vector("ssm_conv1d", p + "ssm_conv1d.weight", (s.conv_kernel, s.conv_channels), "attention"),
            tm.vector("ssm_dt", p + "ssm_dt.bias", (s.value_heads,), "attention"),
            tm.vector("ssm_a", p + "ssm_a", (s.value_heads,), "attention"),
            tm.vector("ssm_norm", p + "ssm_norm.weight", (s.value_dim,), "attention"),
            tm.matmul("ssm_out", [(p + "ssm_out.weight", (values, e))], "attention")]


def gated_attention_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    e, p = config.hidden_size, f"blk.{layer}."
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return [tm.vector("attn_norm", p + "attn_norm.weight", (e,), "attention"),
            tm.matmul("qkv", [(p + "attn_q.weight", (e, 2 * q)), (p + "attn_k.weight", (e, kv)),
                              (p + "attn_v.weight", (e, kv))], "attention"),
            *tm.qk_norm_fields(config, layer, per_head=True),
            tm.matmul("wo", [(p + "attn_output.weight", (q, e))], "attention")]


def layer_kind(config: ModelConfig, layer: int) -> str:
    """What the metadata makes of a layer, for a file whose tensors say otherwise."""
    kind = "linear attention" if config.is_recurrent(layer) else "full attention"
    interval = next((i + 1 for i, recurrent in enumerate(config.recurrent_layers) if not recurrent),
                    f"above {config.num_layers}")
    return f"layer {layer} is {kind} by the metadata, whose full_attention_interval is {interval}"


def block(x: Activations, w: Weights, p: LayerPass, ffn: FFN, layout: LinearLayout = SEPARATE
          ) -> Activations:
    recurrent = p.config.is_recurrent(p.layer_idx)
    mixer = partial(linear_attention, layout=layout) if recurrent else gated_attention
    return pre_norm_block(x, w, p, ffn, mixer=mixer)


def gated_attention(p: LayerPass, w: Weights, x: Activations) -> Activations:
    cfg, kernels = p.config, p.kernels
    tokens, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
    projected = torch.as_tensor(w.qkv(x))  # [T, 2 H D + 2 K D]: per head its query then its gate
    query_gate = projected[:, :2 * heads * d].reshape(tokens, heads, 2, d)
    qkv = torch.cat([query_gate[:, :, 0].reshape(tokens, -1), projected[:, 2 * heads * d:]], dim=-1)
    attended = torch.as_tensor(attend(p, w, norm_each_head(p, w, kernels.take(qkv))))
    gate = query_gate[:, :, 1].reshape(tokens, -1)
    return w.wo(kernels.take(attended * same_bits(torch.sigmoid, gate)))


def linear_attention(p: LayerPass, w: Weights, x: Activations, layout: LinearLayout) -> Activations:
    cfg, s = p.config, p.config.recurrent
    conv_in, z, beta, alpha = layout.unpack(s, torch.as_tensor(w.ssm_in(x)))  # [T, C], [T, H Dv], [T, H] x 2
    g, beta = delta_rule.gates(alpha, beta, torch.as_tensor(w.ssm_dt), torch.as_tensor(w.ssm_a))
    conv_weight = torch.as_tensor(w.ssm_conv1d).reshape(s.conv_channels, s.conv_kernel)
    split = partial(delta_rule.split_heads, key_heads=s.key_heads, value_heads=s.value_heads,
                    interleaved=layout.interleaved_heads, eps=cfg.rms_norm_eps)
    recurrence = Recurrence(conv_weight, None, lambda conv_out: (conv_out,),
                            partial(_delta_rule, delta_rule.stepwise, split),
                            partial(_delta_rule, delta_rule.long_pass, split))
    outs = [seq.recurrent(conv_in[seq.rows], (g[seq.rows], beta[seq.rows]), recurrence)
            for seq in p.sequences]
    o = p.kernels.take(stack_rows(outs))  # [T, H, Dv]
    gate = p.kernels.take(z.reshape(-1, s.value_dim))
    normed = p.kernels.gated_rms_norm(o.reshape(-1, s.value_dim), w.ssm_norm, gate, cfg.rms_norm_eps)
    return w.ssm_out(normed.reshape(o.shape[0], -1))


def _delta_rule(run: Steps, split: Callable, state: torch.Tensor, conv_out: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, buffers: delta_rule.StateBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule (`run`: token by token or a prefill chunk's) over the tokens'
    convolution outputs [T, C], split into each value head's query, key and value."""
    return run(state, *split(conv_out), g, beta, buffers)
