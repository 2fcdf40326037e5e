"""Mamba (llama.cpp's mamba; Gu and Dao's Mamba-1): state-space layers only (state_space.py). A
layer's mixer (llama.cpp's build_mamba_layer), on the normed input, D inner channels, N the state
size, R the time steps' rank:
    x, z = split(h @ ssm_in)                                  [T, D] each
    x = silu(causal_conv(x, ssm_conv1d) + ssm_conv1d.bias)
    dt, B, C = split(x @ ssm_x)                               [T, R], [T, N], [T, N]
    dt = softplus(dt @ ssm_dt + ssm_dt.bias)                  [T, D]
    y = selective scan of x (each channel a head of one) with dt, A = ssm_a [D, N], B, C and D = ssm_d
    out = (y * silu(z)) @ ssm_out
ssm_a is A itself, -exp(A_log), as llama.cpp's converter stores it. dt, B and C are RMS-normed
before dt's projection in two variants: Falcon-Mamba's (ssm.dt_b_c_rms: no weights) and Jamba's
(jamba.py: ssm_dt_norm, ssm_b_norm and ssm_c_norm, each with its weight), where layer_fields and
the mixer are asked for them (`normed`).
"""

from dataclasses import replace
from functools import cache, partial

import numpy as np
import torch

from tierflow.runtime.compute import selective_scan
from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights
from tierflow.runtime.memory.state_shapes import ScanShape
from tierflow.runtime.models import state_space
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import Metadata, ModelConfig


def config(meta: Metadata, vocab_size: int, tied: bool) -> ModelConfig:
    shape = scan_shape(meta)
    base = state_space.config(meta, vocab_size, tied, shape, shape.heads)
    return replace(base, ssm_time_step_rank=meta.count("ssm.time_step_rank"),
                   ssm_dt_b_c_rms=meta.flag("ssm.dt_b_c_rms", False))


def scan_shape(meta: Metadata) -> ScanShape:
    """A Mamba-1 layer's state from the ssm.* keys: ssm.inner_size channels, each a head of one with
    a state of ssm.state_size."""
    kernel, inner, state = state_space.sizes(meta)
    return ScanShape(kernel, conv_channels=inner, heads=inner, head_dim=1, state_size=state, groups=1)


def layer_fields(config: ModelConfig, layer: int, normed: bool = False) -> list[tm.Field]:
    s, rank, p = config.recurrent, config.ssm_time_step_rank, f"blk.{layer}."
    inner, n = s.heads, s.state_size
    norms = [tm.vector(f"ssm_{name}_norm", f"{p}ssm_{name}_norm.weight", (width,), "attention")
             for name, width in (("dt", rank), ("b", n), ("c", n))] if normed else []
    return state_space.mixer_fields(config, layer, inner, 2 * inner) + [
        tm.matmul("ssm_x", [(p + "ssm_x.weight", (inner, rank + 2 * n))], "attention"),
        tm.matmul("ssm_dt", [(p + "ssm_dt.weight", (rank, inner))], "attention", bias="required"),
        tm.vector("ssm_a", p + "ssm_a", (n, inner), "attention"),
        tm.vector("ssm_d", p + "ssm_d", (inner,), "attention")] + norms


def mixer(p: LayerPass, w: Weights, h: Activations, normed: bool = False) -> Activations:
    s = p.config.recurrent
    x, z = torch.as_tensor(w.ssm_in(h)).split(s.heads, dim=-1)  # [T, D] each
    a = torch.as_tensor(w.ssm_a).reshape(s.heads, 1, s.state_size)
    y = state_space.scan(p, w, x, (), partial(_selective_inputs, p, w, normed), a)  # [T, D, 1]
    return w.ssm_out(p.kernels.take(selective_scan.gate(y.reshape(z.shape), z)))


def _selective_inputs(p: LayerPass, w: Weights, normed: bool, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The convolution's outputs [T, D] -> x as heads of one [T, D, 1], B and C [T, 1, N] and the
    time steps [T, D], projected from x (dt, B and C each RMS-normed first where `normed`)."""
    rank, n, take = p.config.ssm_time_step_rank, p.config.recurrent.state_size, p.kernels.take
    dt, b, c = torch.as_tensor(w.ssm_x(take(x))).split([rank, n, n], dim=-1)
    if normed or p.config.ssm_dt_b_c_rms:
        eps = p.config.rms_norm_eps
        weights = ((w.ssm_dt_norm, w.ssm_b_norm, w.ssm_c_norm) if normed
                   else (take(_ones(rank)), take(_ones(n)), take(_ones(n))))
        dt, b, c = (torch.as_tensor(p.kernels.rms_norm(take(v.contiguous()), weight, eps))
                    for v, weight in zip((dt, b, c), weights))
    dt = selective_scan.time_steps(torch.as_tensor(w.ssm_dt(take(dt.contiguous()))))
    return x[:, :, None], b[:, None, :], c[:, None, :], dt


@cache
def _ones(width: int) -> np.ndarray:
    """Falcon-Mamba's norms' weight: none, as ones."""
    return np.ones(width, np.float32)


ARCHITECTURE = Architecture(name="mamba", config=config, layer_fields=layer_fields,
                            block=partial(state_space.block, mixer=mixer),
                            summary="Mamba-1 selective state-space layers, no attention")
