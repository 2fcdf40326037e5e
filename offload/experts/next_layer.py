"""Inter-layer expert prediction: which experts the next MoE layer will use, before it routes.

Two predictors, both giving (expert ids, confidences) that ExpertCache.predict takes:

- The early router: apply layer l+1's router to the hidden state that layer l has. The residual
  stream changes little from one layer to the next, so the next router mostly picks the same
  experts on it (the idea of Pre-gated MoE and HybriMoE's prefetch). It needs the next layer's
  router weight and, for fidelity, its FFN norm, and costs one [T, hidden] x [hidden, E] matmul.
- Cross-layer affinity, as in ExFlow: a token routed to expert i at layer l tends to go to a few
  experts at layer l+1. AffinityPredictor counts, online, how often expert i at layer l is
  followed by expert j at layer l+1 in the same token, and predicts from those counts. It needs
  no weights and no hidden state, so it also serves a trace replay.
"""

import numpy as np

from tierflow.runtime.compute.cpu import DenseLinear
from tierflow.runtime.compute.interfaces import Weights

# a layer's router [E, H], its FFN norm [H] and its selection bias [E] (or None)
EarlyRouter = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def route_top_k(router_weight: np.ndarray, hidden: np.ndarray, top_k: int,
                norm_weight: np.ndarray | None = None, eps: float = 1e-6, gating: str = "softmax",
                selection_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The top_k experts of each token under `router_weight` and their scores.

    E experts, T tokens, H hidden: router_weight [E, H], hidden [T, H] (or [H]), norm_weight [H]
    (an RMSNorm applied first, as the layer does before its router). Returns ids [T, K], highest
    logit first (ties: lower id first), and probs [T, K] from the softmax over all E experts. With
    sigmoid `gating` the scores are the logits' sigmoids, and a selection_bias [E] (exp_probs_b)
    is added to them to rank the experts, as the layer chooses them.
    """
    hidden = np.atleast_2d(np.asarray(hidden, dtype=np.float32))
    router_weight = np.asarray(router_weight, dtype=np.float32)
    num_experts = len(router_weight)
    if router_weight.ndim != 2 or router_weight.shape[1] != hidden.shape[1] or not 0 < top_k <= num_experts:
        raise ValueError(f"router weight {router_weight.shape}, hidden {hidden.shape}, top_k {top_k}: "
                         f"expected [E, H], [T, H] and 1 <= top_k <= E")
    if norm_weight is not None:
        hidden = hidden / np.sqrt(np.mean(hidden * hidden, axis=-1, keepdims=True) + eps) * norm_weight
    logits = hidden @ router_weight.T  # [T, E]
    if gating == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = shifted / shifted.sum(axis=-1, keepdims=True)
    ranked = scores if selection_bias is None else scores + selection_bias
    ids = np.argsort(-ranked, axis=-1, kind="stable")[:, :top_k]  # [T, K]
    return ids, np.take_along_axis(scores, ids, axis=-1)


def early_router(weights: Weights) -> EarlyRouter:
    """What a MoE layer's routing needs to be predicted one layer early (route_top_k): its router's
    matrix in float32, its FFN norm and its selection bias, if it has one."""
    router = weights.router
    matrix = router.weight.numpy() if isinstance(router, DenseLinear) else router.matrix.dequantize()
    bias = weights.fields.get("exp_probs_b")
    return matrix, np.asarray(weights.ffn_norm), None if bias is None else np.asarray(bias)


def merge_token_predictions(ids: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One prediction for a layer step from per-token ones ([T, K] each): every expert any token
    picks, with its highest probability as the confidence, most confident first."""
    best: dict[int, float] = {}
    for e, p in zip(np.ravel(ids).tolist(), np.ravel(probs).tolist()):
        best[e] = max(p, best.get(e, 0.0))
    order = sorted(best, key=lambda e: (-best[e], e))
    return np.array(order, dtype=np.int64), np.array([best[e] for e in order])


class AffinityPredictor:
    """Counts, online, how often a token that used expert i at layer l used expert j at l + 1 (the
    MoE layer after l, where dense layers lie between).

    counts[l, i, j] / seen[l, i] estimates P(j in layer l+1's top-k | i in layer l's top-k).
    `decay` < 1 multiplies a layer's table by it at each observation, so the estimate follows a
    drift in routing (a change of topic) rather than averaging over all history.
    """

    def __init__(self, num_layers: int, num_experts: int, decay: float = 1.0):
        if num_layers < 2 or num_experts < 1 or not 0 < decay <= 1:
            raise ValueError(f"need num_layers >= 2, num_experts >= 1, 0 < decay <= 1; got "
                             f"{num_layers}, {num_experts}, {decay}")
        self.num_experts, self.decay = num_experts, decay
        self.counts = np.zeros((num_layers - 1, num_experts, num_experts))  # [L - 1, E, E]
        self.seen = np.zeros((num_layers - 1, num_experts))  # [L - 1, E]

    def observe(self, layer_idx: int, expert_ids: np.ndarray, next_expert_ids: np.ndarray) -> None:
        """One token's experts at layer_idx ([K]) and at layer_idx + 1 ([K'])."""
        if self.decay < 1:
            self.counts[layer_idx] *= self.decay
            self.seen[layer_idx] *= self.decay
        ids = np.ravel(expert_ids)
        self.counts[layer_idx][np.ix_(ids, np.ravel(next_expert_ids))] += 1
        self.seen[layer_idx][ids] += 1

    def observe_token(self, routing: np.ndarray) -> None:
        """One token's experts at every layer: a row [L, K] of a routing trace."""
        for layer_idx in range(len(routing) - 1):
            self.observe(layer_idx, routing[layer_idx], routing[layer_idx + 1])

    def predict(self, layer_idx: int, expert_ids: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """The top_k likeliest experts at layer_idx + 1 for a token that used `expert_ids` at
        layer_idx, and their probabilities: P(j | i) averaged over the i seen before. Experts never
        seen after any of them are left out (fewer than top_k, none before any observation)."""
        ids = np.ravel(expert_ids)
        seen = self.seen[layer_idx][ids]  # [K]
        known = seen > 0
        if not known.any():
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        likely = (self.counts[layer_idx][ids[known]] / seen[known, None]).mean(axis=0)  # [E]
        order = np.argsort(-likely, kind="stable")[:top_k]
        order = order[likely[order] > 0]
        return order, likely[order]


AFFINITY_MIN = 0.5  # affinity adds to the early router's prediction an expert this likely
AFFINITY_DECAY = 0.99  # per observation: the affinity table follows what the text is about
PRECISION_PRIOR = 2.0  # observations the router's own score counts for in a pick's confidence
PRECISION_DECAY = 0.99  # per layer step: the measured precision follows the text too


class PickPrecision:
    """How often the early router's j-th pick (j < top_k, best first) is among the experts the
    layer then uses, measured online: the confidence a prediction carries. The router's softmax
    score is a poor one: among 128 experts a pick that is used half the time scores a few
    hundredths, so a cache or a gate that trusted it would read almost nothing ahead. Before any
    observation a pick's confidence is its score, which counts for PRECISION_PRIOR observations."""

    def __init__(self, top_k: int):
        self.right = np.zeros(top_k)  # decayed counts of picks that were used, per rank
        self.seen = np.zeros(top_k)  # ... and of all picks

    def observe(self, picks: np.ndarray, used: np.ndarray) -> None:
        """The early router's picks [T, K] for a layer step, and the experts it used [T, k]."""
        hits = (picks[:, :, None] == used[:, None, :]).any(axis=-1)  # [T, K]
        self.right = self.right * PRECISION_DECAY + hits.sum(axis=0)
        self.seen = self.seen * PRECISION_DECAY + len(picks)

    def confidences(self, scores: np.ndarray) -> np.ndarray:
        """[T, K] confidences of picks whose router scores are `scores` [T, K]."""
        return (self.right + PRECISION_PRIOR * scores) / (self.seen + PRECISION_PRIOR)


class NextLayerPredictor:
    """The engine's prediction of the next MoE layer's experts, from each layer step as it runs:
    the next layer's router applied early to this layer's residual stream (each pick as confident
    as such picks have proved: PickPrecision), plus the experts that cross-layer affinity (learnt
    from the tokens' routing, layer to layer) makes likelier than AFFINITY_MIN, each at its best
    confidence."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, eps: float, gating: str = "softmax"):
        self.top_k, self.eps, self.gating = top_k, eps, gating  # gating: the model's (route_top_k)
        self.routers: dict[int, EarlyRouter] = {}
        self.affinity = AffinityPredictor(num_layers, num_experts, AFFINITY_DECAY)
        self._chosen: dict[int, np.ndarray] = {}  # layer -> its tokens' experts, until the next layer's
        self.precision = PickPrecision(top_k)
        self._picks: dict[int, np.ndarray] = {}  # layer -> the early router's picks [T, K], until it routes

    def add_router(self, layer_idx: int, router: np.ndarray, ffn_norm: np.ndarray,
                   selection_bias: np.ndarray | None = None) -> None:
        self.routers[layer_idx] = router, ffn_norm, selection_bias

    def following(self, layer_idx: int) -> int | None:
        """The MoE layer after layer_idx whose experts are predicted (the next with a router: in a
        model with dense layers among the MoE ones, not always layer_idx + 1); None after the last."""
        return min((layer for layer in self.routers if layer > layer_idx), default=None)

    def step(self, layer_idx: int, chosen: np.ndarray, residual: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray] | None:
        """Learns from layer_idx's routing (chosen [T, k]) and predicts the following MoE layer's
        experts (ids, confidences) from it and the residual stream [T, H]; None after the last."""
        previous = max((layer for layer in self._chosen if layer < layer_idx), default=None)
        if previous is not None:  # the same tokens at the MoE layer before, in this pass
            for before, now in zip(self._chosen.pop(previous), chosen):
                self.affinity.observe(previous, before, now)
        self._chosen[layer_idx] = chosen
        picks = self._picks.pop(layer_idx, None)
        if picks is not None and len(picks) == len(chosen):
            self.precision.observe(picks, chosen)
        following = self.following(layer_idx)
        if following is None:
            return None
        router, ffn_norm, bias = self.routers[following]
        picks, scores = route_top_k(router, residual, self.top_k, ffn_norm, self.eps, self.gating, bias)
        self._picks[following] = picks
        ids, probs = [picks.ravel()], [self.precision.confidences(scores).ravel()]
        for token_experts in chosen:
            likely, likelihood = self.affinity.predict(layer_idx, token_experts, self.top_k)
            ids.append(likely[likelihood >= AFFINITY_MIN])
            probs.append(likelihood[likelihood >= AFFINITY_MIN])
        return merge_token_predictions(np.concatenate(ids), np.concatenate(probs))
