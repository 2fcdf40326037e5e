"""The decoder's fixed cost per layer and decode step, measured at one model's shape.

The planner predicts a decode step as its matmuls (bytes over the kernels' measured speeds) plus a
fixed time per layer: norms, rotary, attention over a short context, activations, Python and
dispatch. That fixed time grows with the model's widths, so it is measured for the shape being
planned: the decoder runs that family's block over a few layers whose linears cost nothing
(they return zeros of the right shape), and what a decode step takes is what is not matmuls. No
weights are loaded, so measuring needs a few MB and a fraction of a second.
"""

import time
from dataclasses import replace

import numpy as np
import torch

from tierflow.cpu_kernels import matmul as kernels
from tierflow.offload.tiers.tiered import ResidentExperts
from tierflow.runtime.compute.interfaces import Weights
from tierflow.runtime.decoder.decoder import Decoder
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import ModelConfig
from tierflow.runtime.models.tensor_map import Field, Matmul

MEASURED_LAYERS = 4  # every layer costs the same: a few give a stable mean
CONTEXT = 64  # positions the measured steps attend over (attention's growth is the planner's own term)
PROMPT = 8


def shape_key(config: ModelConfig) -> str:
    """What the fixed cost depends on: the family and its widths."""
    c = config
    experts = (f" e{c.num_experts}/{c.experts_used}x{c.expert_ffn_size}+{c.shared_expert_ffn_size}"
               if c.is_moe else "")
    return (f"{c.arch} h{c.hidden_size} f{c.ffn_size} q{c.num_heads} kv{c.num_kv_heads} d{c.head_dim} "
            f"r{c.rope_dim}{experts}")


def measure_layer_overhead(arch: Architecture, config: ModelConfig, threads: int, steps: int = 24) -> float:
    """Seconds per layer per decode step beyond the matmuls: the median of `steps` steps."""
    layers = min(config.num_layers, MEASURED_LAYERS)
    # A MoE model's dense layers cost less than the rest: layers with experts are measured.
    config = replace(config.first_layers(layers), leading_dense_layers=0, expert_layers=(),
                     context_length=CONTEXT, vocab_size=1)
    source = _CostlessWeights(arch, config)
    decoder = Decoder(config, arch.block, source, CONTEXT)
    cache = KVCache(config, CONTEXT)
    previous = kernels.threads(), torch.get_num_threads()
    kernels.set_threads(threads)
    torch.set_num_threads(1)
    try:
        decoder.forward(np.zeros(PROMPT, np.int64), cache)
        seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            decoder.forward(np.zeros(1, np.int64), cache)
            seconds.append(time.perf_counter() - started)
            cache.truncate(PROMPT)
    finally:
        kernels.set_threads(previous[0])
        torch.set_num_threads(previous[1])
    return float(np.median(seconds)) / config.num_layers


class _ZeroLinear:
    """A linear whose output is zeros: what a layer costs besides its matmuls."""

    def __init__(self, out_features: int):
        self.out_features = out_features

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.zeros((x.shape[0], self.out_features), np.float32)


class _CostlessWeights:
    """A WeightSource of the family's fields: norms of ones, linears of zeros."""

    def __init__(self, arch: Architecture, config: ModelConfig):
        self.layers = [Weights(_fields(arch.layer_fields(config, i)), experts=self._experts(arch, config, i))
                       for i in range(config.num_layers)]
        self.hidden = config.hidden_size

    @staticmethod
    def _experts(arch: Architecture, config: ModelConfig, layer: int) -> ResidentExperts | None:
        if not config.has_experts(layer):
            return None
        return ResidentExperts([Weights(_fields(arch.expert_fields(config, layer, e)))
                                for e in range(config.num_experts)])

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        return np.ones((len(token_ids), self.hidden), np.float32)

    def layer(self, layer_idx: int) -> Weights:
        return self.layers[layer_idx]

    def output_norm(self) -> np.ndarray:
        return np.ones(self.hidden, np.float32)

    def output(self):
        return _ZeroLinear(1)

    def rope_freq_factors(self) -> None:
        return None


def _fields(fields: list[Field]) -> dict:
    made = {}
    for field in fields:
        if isinstance(field.kind, Matmul):
            made[field.name] = _ZeroLinear(sum(w.matrix_shape[0] for w in field.kind.weights))
        else:
            made[field.name] = np.ones(int(np.prod(field.kind.tensor.shape)), np.float32)
    return made
