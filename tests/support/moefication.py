"""MoEfication's fit (make_moe_from_dense.py writes the file, and its docstring gives the method
and what was measured): a dense model runs on real text layer by layer, and each layer's FFN
neurons become a shared expert, E routed experts and a router. T calibration tokens, H hidden
size, F FFN width, E experts, S the shared expert's width."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.torch_ops import apply_rope, rms_norm_reference
from tierflow.offload.gguf.model_file import read_config
from tierflow.offload.gguf.reader import GGUFFile
from tierflow.runtime.decoder.rope import rope_tables
from tierflow.runtime.models.config import ModelConfig

__all__ = ["MoELayer", "dequantized", "fit_experts"]

ROUTER_LOGIT_STD = 1e-3  # w_j within 0.4% of 1/k (1/E). At 1e-2 they spread 3% and moved a k = E
                         # model's first token (massive activations) by 11 logits; at 1e-4 top-k
                         # gaps neared float32 rounding, and tierflow and llama.cpp (both float32)
                         # routed a token of 64 apart
RIDGE = 1e-2             # router fit: ridge strength relative to the mean eigenvalue of x.T @ x
KMEANS_ROUNDS = 20       # at most; the clusters usually settle in under 10
SHARED_GATE_LOGIT = 1e-4  # the shared gate's largest |logit| on the calibration tokens: sigmoid
                          # within 2.5e-5 of 1/2


@dataclasses.dataclass(frozen=True)
class MoELayer:
    experts: np.ndarray  # int64 [E, F/E]: each routed expert's neurons, ascending
    router: np.ndarray   # float32 [E, H]: logits = x @ router.T
    shared: np.ndarray   # int64 [S]: the shared expert's neurons, ascending (S = 0: none)
    shared_gate: np.ndarray | None = None  # float32 [H]: its gate's logits x @ shared_gate, ~0


@torch.inference_mode()
def fit_experts(model: GGUFFile, ids: list[int], num_experts: int, experts_used: int, balance: float = 1.0,
                threads: int = 1, shared_width: int = 0) -> list[MoELayer]:
    """Each layer's shared expert (shared_width neurons, 0: none), num_experts routed experts and
    router, fit on the tokens `ids` layer by layer as the MoE model built so far computes them, with
    experts_used experts a token: one float32 torch pass, all tokens at once."""
    config, previous_threads = read_config(model)[1], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = _embedding_rows(model, ids)  # [T, H], the residual stream
        freq_factors = _tensor(model, "rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None
        cos, sin = rope_tables(config, len(ids), freq_factors)
        eps, layers = config.rms_norm_eps, []
        for layer_idx in range(config.num_layers):
            prefix = f"blk.{layer_idx}."
            h += _attention(model, config, prefix, h, cos, sin)
            x = rms_norm_reference(h, _tensor(model, prefix + "ffn_norm.weight"), eps)  # [T, H]
            gate, up = _tensor(model, prefix + "ffn_gate.weight"), _tensor(model, prefix + "ffn_up.weight")
            acts = F.silu(x @ gate.T) * (x @ up.T)  # [T, F]
            down = _tensor(model, prefix + "ffn_down.weight")  # [H, F]
            layers.append(_fit_layer(x.numpy(), acts.abs().numpy(), down.norm(dim=0).numpy(), num_experts,
                                     shared_width, balance, seed=layer_idx))
            h += _routed(x, acts, layers[-1], experts_used) @ down.T
        return layers
    finally:
        torch.set_num_threads(previous_threads)


def _tensor(model: GGUFFile, name: str) -> torch.Tensor:
    return torch.from_numpy(dequantized(model, name))  # float32, numpy order ([out, in])


def _embedding_rows(model: GGUFFile, ids: list[int]) -> torch.Tensor:
    """token_embd's rows for `ids` [T, H], dequantizing only those."""
    info = model.tensors["token_embd.weight"]
    rows = model.tensor_data(info.name).reshape(info.shape[1], -1)[ids]  # [T, row bytes]
    return torch.from_numpy(dequantize(rows.ravel(), info.ggml_type, (info.shape[0], len(ids))))


def _attention(model: GGUFFile, config: ModelConfig, prefix: str, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of a llama or qwen2 block (q, k and v biases where the file has them;
    the config's rope style and theta), attn_norm included: h [T, H] -> [T, H]."""
    x = rms_norm_reference(h, _tensor(model, prefix + "attn_norm.weight"), config.rms_norm_eps)
    heads = {}  # name -> [heads, T, D]
    for name, count in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads)):
        projected = x @ _tensor(model, f"{prefix}attn_{name}.weight").T  # [T, heads * D]
        if f"{prefix}attn_{name}.bias" in model.tensors:  # qwen2's
            projected += _tensor(model, f"{prefix}attn_{name}.bias")
        heads[name] = projected.unflatten(-1, (count, -1)).transpose(0, 1)
    q, k = (apply_rope(heads[name], cos, sin, config.rope_style) for name in ("q", "k"))
    out = F.scaled_dot_product_attention(q, k, heads["v"], is_causal=True, enable_gqa=True)  # [H, T, D]
    return out.transpose(0, 1).flatten(1) @ _tensor(model, prefix + "attn_output.weight").T


def _routed(x: torch.Tensor, acts: torch.Tensor, layer: MoELayer, experts_used: int) -> torch.Tensor:
    """acts [T, F] with every neuron outside the shared expert and the token's top-k experts
    zeroed: what the MoE file computes, its chosen weights (~1/k or ~1/E, and the shared gate's
    1/2) times the downs' scales aside."""
    num_experts = len(layer.experts)
    chosen = (x @ torch.from_numpy(layer.router).T).topk(experts_used).indices  # [T, k]
    kept = torch.zeros(len(x), num_experts + 1, dtype=torch.bool).scatter_(1, chosen, True)  # [T, E + 1]
    kept[:, num_experts] = True  # the shared expert's column
    owner = np.full(acts.shape[1], num_experts)  # [F]: each neuron's expert, E for the shared one
    owner[layer.experts] = np.arange(num_experts)[:, None]
    return acts * kept[:, torch.from_numpy(owner)]


def _fit_layer(x: np.ndarray, acts: np.ndarray, down_norms: np.ndarray, num_experts: int, shared_width: int,
               balance: float, seed: int) -> MoELayer:
    """Experts and router from a layer's FFN inputs x [T, H], neuron activations |a| [T, F] and
    down's column norms [F]."""
    shared = _shared_neurons(acts, down_norms, shared_width)
    rest = np.setdiff1d(np.arange(acts.shape[1]), shared)  # [E * F/E], ascending
    experts = rest[_cluster_neurons(acts[:, rest], num_experts, seed)]
    mass = acts[:, experts].sum(axis=-1)  # [T, E]
    router = _fit_router(x, mass / mass.mean(axis=0) ** balance)
    return MoELayer(experts, router, shared, _shared_gate(x) if shared_width else None)


def _shared_neurons(acts: np.ndarray, down_norms: np.ndarray, width: int) -> np.ndarray:
    """The `width` neurons of most output energy over the tokens, rms(a) * |down column|
    (see the module doc for the choices it beat), ascending."""
    energy = np.sqrt((acts.astype(np.float64) ** 2).mean(axis=0)) * down_norms  # [F]
    return np.sort(np.argsort(-energy, kind="stable")[:width])


def _shared_gate(x: np.ndarray) -> np.ndarray:
    """The shared expert's gate row [H]: along the tokens' mean, scaled so that its logits stay
    within SHARED_GATE_LOGIT of 0 on the calibration tokens, where sigmoid is 1/2 to within
    2.5e-5 (down is scaled by 2). Not zero: llama.cpp computes the sigmoid as silu(g) / g, NaN
    at g = 0. Along the mean, g is seldom near 0: in the 0.5B Qwen's layers past the first every
    calibration token's g had one sign and at least 1% of the largest |g|."""
    mean = x.mean(axis=0)  # [H]
    return (mean * (SHARED_GATE_LOGIT / np.abs(x @ mean).max())).astype(np.float32)


def _cluster_neurons(acts: np.ndarray, num_experts: int, seed: int) -> np.ndarray:
    """Balanced spherical k-means of the neurons' activation patterns acts [T, F]: neuron ids
    [E, F/E], so that an expert's neurons fire for similar tokens."""
    patterns = acts.T / (np.linalg.norm(acts.T, axis=1, keepdims=True) + 1e-12)  # [F, T]
    rng = np.random.default_rng(seed)
    centroids = patterns[rng.choice(len(patterns), num_experts, replace=False)]  # [E, T]
    labels = None
    for _ in range(KMEANS_ROUNDS):
        new_labels = _balanced_assign(patterns @ centroids.T)
        if labels is not None and np.array_equal(new_labels, labels):
            break
        labels = new_labels
        centroids = np.eye(num_experts, dtype=np.float32)[labels].T @ patterns  # [E, T], summed
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return np.argsort(labels, kind="stable").reshape(num_experts, -1)


def _balanced_assign(scores: np.ndarray) -> np.ndarray:
    """Each of F neurons to one of E clusters, F/E per cluster, from similarities [F, E]: neurons
    propose to their preferred clusters in turn and a full cluster keeps its most similar ones
    (deferred acceptance, so no neuron and cluster would both rather be together)."""
    num_neurons, num_clusters = scores.shape
    capacity = num_neurons // num_clusters
    preferences = np.argsort(-scores, axis=1)  # [F, E]
    proposals = np.zeros(num_neurons, np.int64)  # how many clusters each neuron has asked
    labels = np.full(num_neurons, -1)
    while (free := np.flatnonzero(labels < 0)).size:
        labels[free] = preferences[free, proposals[free]]
        proposals[free] += 1
        for cluster in np.unique(labels[free]):
            members = np.flatnonzero(labels == cluster)
            labels[members[np.argsort(-scores[members, cluster])[capacity:]]] = -1
    return labels


def _fit_router(x: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Router [E, H] whose logits x @ router.T rank experts as target [T, E] does, at
    ROUTER_LOGIT_STD. Softmax ignores a token's common shift, so the fit is to target centred
    per token; there is no bias (GGUF routers have none)."""
    target = target - target.mean(axis=1, keepdims=True)
    gram = x.T.astype(np.float64) @ x  # [H, H]
    ridge = RIDGE * np.trace(gram) / len(gram)
    weights = np.linalg.solve(gram + ridge * np.eye(len(gram)), x.T @ target)  # [H, E]
    logits = x @ weights
    logits -= logits.mean(axis=1, keepdims=True)
    return (weights.T * (ROUTER_LOGIT_STD / logits.std())).astype(np.float32)


def dequantized(model: GGUFFile, name: str) -> np.ndarray:
    """A tensor in float32, numpy order ([out, in])."""
    info = model.tensors[name]
    return dequantize(model.tensor_data(name), info.ggml_type, info.shape)
