"""Attention over a KV cache in RAM for layers computed on a device (kv_on_cpu, llama.cpp's -nkvo):
the device computes the layer's matmuls, the CPU kernels attend over the cache, and only the
layer's queries, keys and values and its attention output cross between them."""

import numpy as np
import torch

from tierflow.runtime.compute.cpu import CPU_KERNELS
from tierflow.runtime.compute.interfaces import Kernels, Weights, WeightSource


def _host(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """x as a contiguous float32 array in RAM (attention rotates qkv in place: a copy is fine)."""
    return np.ascontiguousarray(x if isinstance(x, np.ndarray) else x.cpu().numpy(), np.float32)


class HostAttention:
    """A device's kernels, but attention by the CPU kernels over caches in RAM."""

    def __init__(self, kernels: Kernels):
        self.kernels = kernels

    def __getattr__(self, name: str):
        return getattr(self.kernels, name)

    def attention(self, qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start, window=0,
                  scale=None, softcap=0.0, held_from=0, sinks=None):
        out = CPU_KERNELS.attention(_host(qkv), keys, values, _host(cos), _host(sin), heads, start, neox,
                                    parents, tree_start, window, scale, softcap, held_from,
                                    None if sinks is None else _host(sinks))
        return self.kernels.take(out)

    @staticmethod
    def over(weights: WeightSource) -> WeightSource:
        """The weight source whose device layers attend with HostAttention."""
        return _HostAttentionSource(weights)


class _HostAttentionSource:
    def __init__(self, weights: WeightSource):
        self._weights = weights
        # One per device's kernels: the decoder moves the rotary rows once per kernels and pass.
        self._wrapped: dict[Kernels, HostAttention] = {}

    def __getattr__(self, name: str):
        return getattr(self._weights, name)

    def layer(self, layer_idx: int) -> Weights:
        w = self._weights.layer(layer_idx)
        if w.kernels is CPU_KERNELS:
            return w
        if w.kernels not in self._wrapped:
            self._wrapped[w.kernels] = HostAttention(w.kernels)
        return Weights(w.fields, self._wrapped[w.kernels], w.experts)
