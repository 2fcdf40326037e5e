"""NVIDIA Nemotron-H (llama.cpp's nemotron_h) and its mixture-of-experts form, Nemotron 3
(nemotron_h_moe): each layer one of three kinds, told by its per-layer counts (ssm_hybrid.py):
Mamba-2 (mamba2.py; `attention.head_count_kv` and `feed_forward_length` both 0), attention without
rotary (head_count_kv alone set) or an FFN (feed_forward_length alone set), whose up-projection is
squared after a ReLU and which has no gate. Each block is x += mixer(attn_norm(x)), with the
layer's mixer and its one norm; no norm mixes the kinds. The attention's and the FFN's biases are
used where the file has them.

With `expert_count` set, every FFN layer is a mixture of such squared-ReLU experts (llama.cpp's
build_ffn_layer): the router reads the normed input, sigmoid scores choose the top k with the
selection bias exp_probs_b, their weights normalised where `expert_weights_norm` and scaled by
`expert_weights_scale`; an ungated squared-ReLU shared expert of `expert_shared_feed_forward_length`
adds to them. With `moe_latent_size` (Nemotron 3 Super) the experts compute in that latent width:
the input projected down by ffn_latent_down first, their sum up by ffn_latent_up after.
"""

from dataclasses import replace
from functools import partial

import torch

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.compute.interfaces import Activations, Kernels, LayerPass, Weights
from tierflow.runtime.models import mamba2, ssm_hybrid
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import Metadata, ModelConfig
from tierflow.runtime.models.layers import attention, routed_experts, scored_top_k


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    if meta.count("nextn_predict_layers", 0, minimum=0):
        raise UnsupportedModelError(f"{meta.arch}.nextn_predict_layers is set: tierflow does not read "
                                    f"Nemotron 3's multi-token-prediction blocks yet (a file without "
                                    f"them runs)")
    layers = meta.count("block_count")
    kv = ssm_hybrid.per_layer(meta, "attention.head_count_kv", layers)
    ffn = ssm_hybrid.per_layer(meta, "feed_forward_length", layers)
    types = tuple(_layer_type(meta, i, heads, width) for i, (heads, width) in enumerate(zip(kv, ffn)))
    base = ssm_hybrid.hybrid_config(meta, vocab_size, tied, types, rope_style="none", experts="optional",
                                    expert_ffn_key=True, shared_expert=True)
    if not base.is_moe:
        return base
    return replace(base, expert_layers=tuple(t == "ffn" for t in types), expert_gating="sigmoid",
                   expert_weights_norm=meta.flag("expert_weights_norm", False),
                   expert_weights_scale=meta.number("expert_weights_scale", 0.0) or 1.0,
                   moe_latent_size=meta.count("moe_latent_size", 0, minimum=0))


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
    if config.has_experts(layer):  # the layer's one norm is the router's: named as the expert tiers ask
        return [tm.vector("ffn_norm", p + "attn_norm.weight", (e,), "router"), *_moe_fields(config, layer)]
    return [tm.vector("attn_norm", p + "attn_norm.weight", (e,), "ffn"),
            tm.matmul("up", [(p + "ffn_up.weight", (e, f))], "ffn", bias="optional"),
            tm.matmul("down", [(p + "ffn_down.weight", (f, e))], "ffn", bias="optional")]


def _moe_fields(config: ModelConfig, layer: int) -> list[tm.Field]:
    """A MoE layer's own extent: its router and selection bias, the latent projections where the
    experts have a latent width, and the shared expert."""
    e, n, s, latent, p = (config.hidden_size, config.num_experts, config.shared_expert_ffn_size,
                          config.moe_latent_size, f"blk.{layer}.")
    fields = [tm.matmul("router", [(p + "ffn_gate_inp.weight", (e, n))], "router", requantize=False),
              tm.selection_bias_field(config, layer),
              tm.matmul("shared_up", [(p + "ffn_up_shexp.weight", (e, s))], "router"),
              tm.matmul("shared_down", [(p + "ffn_down_shexp.weight", (s, e))], "router")]
    if latent:
        fields += [tm.matmul("latent_down", [(p + "ffn_latent_down.weight", (e, latent))], "router"),
                   tm.matmul("latent_up", [(p + "ffn_latent_up.weight", (latent, e))], "router")]
    return fields


def expert_fields(config: ModelConfig, layer: int, expert: int) -> list[tm.Field]:
    """One routed expert, ungated: its slices of the stacked up and down tensors, in the latent
    width where the model has one."""
    width, f, n = config.moe_latent_size or config.hidden_size, config.expert_ffn_size, config.num_experts
    p = f"blk.{layer}."
    return [tm.matmul("up", [(p + "ffn_up_exps.weight", (width, f, n))], "expert", expert=expert),
            tm.matmul("down", [(p + "ffn_down_exps.weight", (f, width, n))], "expert", expert=expert)]


def relu_squared(kernels: Kernels, up, down, h: Activations) -> Activations:
    """down(relu(up h)^2), [T, E] -> [T, E]."""
    hidden = torch.relu(torch.as_tensor(up(h)))
    return down(kernels.take(hidden * hidden))


def relu_squared_ffn(p: LayerPass, w: Weights, h: Activations) -> Activations:
    return relu_squared(p.kernels, w.up, w.down, h)


def relu_squared_experts(kernels: Kernels, experts: list[Weights], hs: list[Activations]
                         ) -> list[Activations]:
    """Each expert's down(relu(up h)^2), the experts' products together."""
    ups = [torch.relu(torch.as_tensor(y)) for y in kernels.linear_each([e.up for e in experts], hs)]
    return kernels.linear_each([e.down for e in experts], [kernels.take(u * u) for u in ups])


def relu_squared_moe(p: LayerPass, w: Weights, h: Activations, residual: Activations) -> Activations:
    """The routed experts (in the latent width, where there is one) plus the shared expert."""
    router = scored_top_k(p.config, w.fields.get("exp_probs_b"))
    latent = p.config.moe_latent_size
    x = p.kernels.take(w.latent_down(h)) if latent else h
    out = routed_experts(p, w, x, residual, router, relu_squared_experts, router_input=h)
    if latent:
        out = w.latent_up(p.kernels.take(out))
    shared = relu_squared(p.kernels, w.shared_up, w.shared_down, h)
    return torch.as_tensor(out) + torch.as_tensor(shared)


MIXERS = {"recurrent": mamba2.mixer, "attention": attention, "ffn": relu_squared_ffn}


def block(x: Activations, w: Weights, p: LayerPass) -> Activations:
    kind = p.config.layer_types[p.layer_idx]
    moe = kind == "ffn" and p.config.has_experts(p.layer_idx)
    h = p.kernels.rms_norm(x, w.ffn_norm if moe else w.attn_norm, p.config.rms_norm_eps)
    mixer = partial(relu_squared_moe, residual=x) if moe else MIXERS[kind]
    x += p.kernels.take(mixer(p, w, h))
    return x


ARCHITECTURE = Architecture(name="nemotron_h", config=config, layer_fields=layer_fields, block=block,
                            expert_fields=expert_fields, layer_kind=ssm_hybrid.layer_kind,
                            summary="each layer Mamba-2, attention without rotary, or a squared-ReLU FFN "
                                    "(or squared-ReLU experts with a shared one)")
# Nemotron 3 (Nano 30B-A3B, Super): the same layers, llama.cpp's name for the files with experts
MOE_ARCHITECTURE = replace(ARCHITECTURE, name="nemotron_h_moe",
                           summary="Nemotron 3: Mamba-2, attention without rotary, and squared-ReLU experts "
                                   "with a shared one, optionally in a latent width")
