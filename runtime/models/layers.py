"""The parts of a block that families share, written against the `Kernels` protocol.

A family's block composes these (pre_norm_block or Gemma's sandwich_norm_block, attention with or
without q/k norms, a SwiGLU or GeGLU FFN or a mixture of experts with its routing rule); the same
block runs on the CPU kernels and on the GPU kernels, since everything device-specific goes through
`p.kernels` and the weights' own linears.

Shape legend: T new tokens, H query heads, K key/value heads, D head size, E hidden size,
N experts in the layer, k experts used per token.
"""

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierflow.runtime.compute.interfaces import (
    Activations,
    Kernels,
    LayerPass,
    Linear,
    Weights,
    concat,
    stack_rows,
)
from tierflow.runtime.models.config import ModelConfig

FFN = Callable[[LayerPass, Weights, Activations, Activations], Activations]  # (p, w, h, residual)
QKNorm = Callable[[LayerPass, Weights, Activations], Activations]  # qkv -> qkv
Mixer = Callable[[LayerPass, Weights, Activations], Activations]  # a layer's normed input -> its tokens mixed
Router = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # logits [T, N], k -> weights,
# chosen experts, each [T, k]
ExpertFFN = Callable[[Kernels, Sequence[Weights], Sequence[Activations]], list[Activations]]  # experts
# on one device, each with its tokens' rows of h -> each one's output


def pre_norm_block(x: Activations, w: Weights, p: LayerPass, ffn: FFN, qk_norm: QKNorm | None = None,
                   mixer: Mixer | None = None) -> Activations:
    """x + attention(norm(x)), then + ffn(norm(x)): the block of Llama and its descendants; `mixer`
    in attention's place where the layer mixes its tokens otherwise (a recurrent layer's)."""
    kernels, eps = p.kernels, p.config.rms_norm_eps
    h = kernels.rms_norm(x, w.attn_norm, eps)
    mixed = attention(p, w, h, qk_norm) if mixer is None else mixer(p, w, h)
    h = kernels.add_rms_norm(x, mixed, w.ffn_norm, eps)  # x: the residual stream entering the FFN
    x += ffn(p, w, h, x)
    return x


def sandwich_norm_block(x: Activations, w: Weights, p: LayerPass, ffn: FFN, qk_norm: QKNorm | None = None
                        ) -> Activations:
    """Gemma's block: the attention's and the FFN's outputs are normed again before each joins the
    residual stream (attn_post_norm, ffn_post_norm), four norms in all."""
    kernels, eps = p.kernels, p.config.rms_norm_eps
    attended = attention(p, w, kernels.rms_norm(x, w.attn_norm, eps), qk_norm)
    h = kernels.add_rms_norm(x, kernels.rms_norm(attended, w.attn_post_norm, eps), w.ffn_norm, eps)
    x += kernels.rms_norm(ffn(p, w, h, x), w.ffn_post_norm, eps)
    return x


def attention(p: LayerPass, w: Weights, x: Activations, qk_norm: QKNorm | None = None) -> Activations:
    """Causal self-attention with rotary positions over the layer's KV cache, with the layer's
    sliding window, the model's score scale and soft cap, and the layer's attention sinks where its
    map has them (`attn_sinks` [H]): x [T, E] -> [T, E]."""
    qkv = w.qkv(x)  # [T, H*D + 2*K*D]
    if qk_norm is not None:
        qkv = qk_norm(p, w, qkv)
    return w.wo(attend(p, w, qkv))


def attend(p: LayerPass, w: Weights, qkv: Activations) -> Activations:
    """The attention kernel over each sequence's KV cache: queries, keys and values side by side
    [T, H*D + 2*K*D] (before rotary) -> the heads' outputs [T, H*D]."""
    cfg = p.config
    sinks = w.fields.get("attn_sinks")
    outs = [p.kernels.attention(qkv[s.rows], s.keys, s.values, p.cos[s.rows], p.sin[s.rows], cfg.num_heads,
                                s.start, cfg.rope_style == "neox", s.parents, s.tree_start,
                                cfg.window(p.layer_idx), cfg.query_scale, cfg.attn_logit_softcap, s.held_from,
                                sinks)
            for s in p.sequences]
    return stack_rows(outs)


def norm_whole_projections(p: LayerPass, w: Weights, qkv: Activations) -> Activations:
    """RMSNorm over all of the queries and all of the keys (weights [H*D], [K*D]), before rotary."""
    q, k, v = _split_qkv(p.config, qkv)
    eps, kernels = p.config.rms_norm_eps, p.kernels
    return concat([kernels.rms_norm(q, w.q_norm, eps), kernels.rms_norm(k, w.k_norm, eps), v])


def norm_each_head(p: LayerPass, w: Weights, qkv: Activations) -> Activations:
    """RMSNorm over each head's query and key (weights [D], shared by the heads), before rotary;
    each only where the layer has its weight (GLM-4.5's are optional)."""
    cfg, kernels = p.config, p.kernels
    q, k, v = _split_qkv(cfg, qkv)
    tokens, d, eps = qkv.shape[0], cfg.head_dim, cfg.rms_norm_eps
    if "q_norm" in w.fields:
        q = kernels.rms_norm(q.reshape(tokens * cfg.num_heads, d), w.q_norm, eps).reshape(tokens, -1)
    if "k_norm" in w.fields:
        k = kernels.rms_norm(k.reshape(tokens * cfg.num_kv_heads, d), w.k_norm, eps).reshape(tokens, -1)
    return concat([q, k, v])


def swiglu(kernels: Kernels, gate_up: Linear, down: Linear, h: Activations) -> Activations:
    """down(silu(gate h) * up h), gate and up one linear."""
    return down(kernels.swiglu(gate_up, h))


def swiglu_experts(kernels: Kernels, experts: Sequence[Weights], hs: Sequence[Activations]
                   ) -> list[Activations]:
    """Each expert's SwiGLU (gate_up, down) of its h, the experts' products together."""
    acts = kernels.swiglu_each([e.gate_up for e in experts], hs)
    return kernels.linear_each([e.down for e in experts], acts)


def clamped_swiglu_experts(kernels: Kernels, experts: Sequence[Weights], hs: Sequence[Activations]
                           ) -> list[Activations]:
    """gpt-oss's experts: down(g * sigmoid(1.702 g) * (u + 1)) with g = min(gate h, 7) and u = up h
    clamped to [-7, 7], in ggml's float32 steps (swiglu_oai: g / (1 + exp(1.702 * -g)))."""
    acts = kernels.swiglu_oai_each([e.gate_up for e in experts], hs)
    return kernels.linear_each([e.down for e in experts], acts)


def dense_ffn(p: LayerPass, w: Weights, h: Activations, residual: Activations) -> Activations:
    return swiglu(p.kernels, w.gate_up, w.down, h)


def geglu_ffn(p: LayerPass, w: Weights, h: Activations, residual: Activations) -> Activations:
    """down(gelu(gate h) * up h), GELU's tanh form as llama.cpp's CPU backend computes it (see
    gelu_as_llama_cpp)."""
    gate, up = torch.as_tensor(w.gate_up(h)).chunk(2, dim=-1)  # [T, F] each
    return w.down(p.kernels.take(gelu_as_llama_cpp(gate) * up))


def gelu_as_llama_cpp(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh form) as ggml's CPU GeGLU computes it on float32: x rounded to float16 and looked
    up in a table of float16 results; 0 at or below -10 and x itself at or above 10. An exact
    oracle needs the same rounding (a relative 2^-11 per activation), and a lookup gives every
    token the same bits whatever its batch."""
    table = _gelu_table(x.device)
    codes = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    looked_up = table[codes]
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, looked_up))


@functools.cache
def _gelu_table(device: torch.device) -> torch.Tensor:
    """float32 [65536]: for each float16 bit pattern x, gelu(x) evaluated in float32 in ggml's
    order (0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))) and rounded to float16."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    inner = 0.7978845608028654 * x * (1.0 + 0.044715 * x * x)  # float32 throughout
    gelu = 0.5 * x * (1.0 + torch.tanh(inner))
    return gelu.to(torch.float16).float().to(device)


def scored_top_k(config: ModelConfig, selection_bias: Activations | None = None) -> Router:
    """Routing as llama.cpp's build_moe_ffn does it from the config, for every family: each
    expert's score is the softmax or the sigmoid of its logit, or the logit itself
    (config.expert_gating); each token takes the k experts of highest score + selection_bias ([N],
    exp_probs_b: it changes which experts are chosen, never their weights), weighted by their
    scores (softmax_weight: by the softmax of those k logits), rescaled to sum to 1 where
    expert_weights_norm (the sum held at least 2^-14, as llama.cpp clamps it), then multiplied by
    expert_weights_scale. With expert_groups > 1, only the experts of each token's best groups can
    be chosen (keep_best_groups)."""
    bias = None if selection_bias is None else torch.as_tensor(selection_bias)
    gating = {"softmax": functools.partial(torch.softmax, dim=-1), "sigmoid": torch.sigmoid,
              "softmax_weight": lambda logits: logits}[config.expert_gating]

    def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores = gating(logits.float())  # [T, N]
        selection = scores if bias is None else scores + bias.to(scores.device)
        if config.expert_groups > 1:
            selection = keep_best_groups(selection, config.expert_groups, config.expert_groups_used)
        chosen = selection.topk(k, dim=-1).indices  # [T, k]
        weights = scores.gather(-1, chosen)
        if config.expert_gating == "softmax_weight":
            weights = torch.softmax(weights, dim=-1)
        if config.expert_weights_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=2.0 ** -14)
        scale = config.expert_weights_scale
        return (weights if scale == 1.0 else weights * scale), chosen  # a step's op less where it is 1

    return route


def keep_best_groups(selection: torch.Tensor, groups: int, used: int) -> torch.Tensor:
    """llama.cpp's grouped selection (DeepSeek-V3's n_group, topk_group): the N experts form
    `groups` equal groups, each scored by the sum of its two best selection scores; a token's
    experts outside its `used` best groups get -inf. selection [T, N] -> [T, N]."""
    tokens, n = selection.shape
    grouped = selection.view(tokens, groups, n // groups)  # [T, G, N/G]
    group_scores = grouped.topk(min(2, n // groups), dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_scores.topk(used, dim=-1).indices  # [T, used]
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, best, False)
    return grouped.masked_fill(dropped[..., None], float("-inf")).view(tokens, n)


def moe_ffn(p: LayerPass, w: Weights, h: Activations, residual: Activations,
            expert_ffn: ExpertFFN = swiglu_experts) -> Activations:
    """A mixture of experts: the config's router (scored_top_k, with the layer's selection bias
    where it has one) picks each token's experts, whose outputs (expert_ffn: SwiGLU unless the
    family says otherwise) are summed with the router's weights; where the model has a shared
    expert, every token's output adds it, scaled by sigmoid(h @ shared_gate) where the layer has
    that gate (Qwen2-MoE) and as it is otherwise (GLM-4.5, DeepSeek-V2/V3)."""
    router = scored_top_k(p.config, w.fields.get("exp_probs_b"))
    out = routed_experts(p, w, h, residual, router, expert_ffn)
    if p.config.shared_expert_ffn_size:
        shared = shared_expert_output(p, w, h)
        if "shared_gate" in w.fields:
            shared *= torch.sigmoid(torch.as_tensor(w.shared_gate(h)))  # [T, 1]
        torch.as_tensor(out).add_(shared)  # in place, on the layer's device
    return out


def shared_expert_output(p: LayerPass, w: Weights, h: Activations) -> torch.Tensor:
    """The SwiGLU expert every token uses (shared_gate_up, shared_down): [T, E]."""
    return torch.as_tensor(swiglu(p.kernels, w.shared_gate_up, w.shared_down, h))


def routed_experts(p: LayerPass, w: Weights, h: Activations, residual: Activations, router: Router,
                   expert_ffn: ExpertFFN = swiglu_experts, router_input: Activations | None = None
                   ) -> Activations:
    """Each expert computes all the tokens routed to it at once, and the experts of a group that
    `w.experts` hands over (wherever they live, in the order it picks) on one device compute
    together; each token sums its experts' outputs, weighted, in the order the router ranked them
    (as llama.cpp does: p.kernels.combine_experts), so the result does not depend on the order
    they came in. residual [T, E] (the stream entering the FFN) lets the experts' source predict
    the next layer's routing; router_input is what the router reads where it is not h (Nemotron
    3 Super's experts compute in a latent width, its router on the hidden state). A choice the
    source drops (Experts.dropped: an approximation the user asked for) weighs 0 and its token's
    other experts share its weight, in proportion to theirs. The bookkeeping is numpy on small
    arrays: a decode step runs it once per layer, where torch's per-operation cost was a tenth of
    the layer's time."""
    logits = w.router(h if router_input is None else router_input)
    weights, chosen = router(torch.as_tensor(logits), p.config.experts_used)  # [T, k] each
    chosen_ids = chosen.cpu().numpy()
    if p.on_routing is not None:
        p.on_routing(p.layer_idx, chosen_ids, weights, residual, w)
    dropped = w.experts.dropped(chosen_ids, weights, any(s.parents is not None for s in p.sequences))
    if dropped is not None:
        weights = _without(weights, dropped)
    kept_ids = chosen_ids if dropped is None else np.where(dropped, -1, chosen_ids)
    order, experts, tokens = _choices_by_expert(kept_ids)
    tokens_of = dict(zip(experts, tokens))
    outputs = {}  # expert id -> its output rows (on its device)
    for group in w.experts.groups(chosen_ids, residual, dropped):
        for kernels, members in _by_kernels(group).items():
            xs = [kernels.take(_expert_rows(h, tokens_of[e])) for e, _ in members]
            ys = expert_ffn(kernels, [expert for _, expert in members], xs)
            outputs.update(zip((e for e, _ in members), ys))
    picks = np.empty_like(order)
    picks[order] = np.arange(order.size) - (order.size - sum(map(len, tokens)))  # among the kept rows
    np.maximum(picks, 0, out=picks)  # a dropped choice (weight 0) points at any row
    return p.kernels.combine_experts([outputs[e] for e in experts], picks.reshape(chosen_ids.shape), weights)


def _without(weights: torch.Tensor, dropped: np.ndarray) -> torch.Tensor:
    """The router weights [T, k] with the dropped choices' given to the token's others, in proportion."""
    kept = weights * torch.from_numpy(~dropped).to(weights.device)
    total, left = weights.sum(dim=-1, keepdim=True), kept.sum(dim=-1, keepdim=True)
    return kept * (total / left.clamp(min=torch.finfo(left.dtype).tiny))


def _choices_by_expert(chosen_ids: np.ndarray) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """chosen_ids [T, k] -> the order of the T * k choices by expert (tokens ascending; dropped
    choices, -1, first), the experts chosen (ascending) and each one's tokens (ascending)."""
    choices = chosen_ids.reshape(-1)
    order = np.argsort(choices, kind="stable")
    ranked = choices[order]
    first = np.empty(ranked.size, bool)  # where each expert's run of choices begins
    first[0] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    starts = np.flatnonzero(first & (ranked >= 0))
    bounds, token_rows = [*starts.tolist(), ranked.size], order // chosen_ids.shape[1]
    return order, ranked[starts].tolist(), [token_rows[a:b] for a, b in zip(bounds, bounds[1:])]


def _expert_rows(h: Activations, rows: np.ndarray) -> Activations:
    """The rows of the tokens that chose an expert (ascending): all of them as they are, when all did."""
    if len(rows) == len(h):
        return h
    return h[rows] if isinstance(h, np.ndarray) else h[torch.from_numpy(rows).to(h.device)]


def _by_kernels(group: list[tuple[int, Weights]]) -> dict[Kernels, list[tuple[int, Weights]]]:
    """A group's experts by the kernels (the device) that compute them, in the group's order."""
    by_kernels: dict[Kernels, list[tuple[int, Weights]]] = {}
    for member in group:
        by_kernels.setdefault(member[1].kernels, []).append(member)
    return by_kernels


def _split_qkv(cfg: ModelConfig, qkv: Activations) -> tuple[Activations, Activations, Activations]:
    q_end = cfg.num_heads * cfg.head_dim
    k_end = q_end + cfg.num_kv_heads * cfg.head_dim
    return tuple(_contiguous(qkv[:, a:b]) for a, b in ((0, q_end), (q_end, k_end), (k_end, qkv.shape[1])))


def _contiguous(x: Activations) -> Activations:
    return np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x.contiguous()
