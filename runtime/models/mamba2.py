"""Mamba-2 (llama.cpp's mamba2): state-space layers only (state_space.py). A layer's mixer
(llama.cpp's build_mamba2_layer), on the normed input, D inner channels in H heads of P, B and C in
G groups of N, each shared by H / G heads:
    z, xBC, dt = split(h @ ssm_in)                            [T, D], [T, D + 2 G N], [T, H]
    x, B, C = split(silu(causal_conv(xBC, ssm_conv1d) + ssm_conv1d.bias))
    dt = softplus(dt + ssm_dt.bias)
    y = selective scan of x with dt, a scalar decay per head A = ssm_a [H], B, C and D = ssm_d [H]
    out = grouped_rms_norm(y * silu(z)) @ ssm_out             (per group of D / G channels, ssm_norm's:
                                                              selective_scan.gate)
A family whose map makes ssm_norm optional (layer_fields' `norm_optional`) skips the norm where a
file has none.
"""

from functools import partial

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
    return state_space.config(meta, vocab_size, tied, shape, shape.heads * shape.head_dim)


def scan_shape(meta: Metadata) -> ScanShape:
    """A Mamba-2 layer's state from the ssm.* keys: ssm.time_step_rank heads over ssm.inner_size
    channels, B and C in ssm.group_count groups of ssm.state_size."""
    kernel, inner, state = state_space.sizes(meta)
    head_dim = state_space.divides(meta, "ssm.time_step_rank", "ssm.inner_size")
    state_space.divides(meta, "ssm.group_count", "ssm.time_step_rank")
    heads, groups = inner // head_dim, meta.count("ssm.group_count")
    return ScanShape(kernel, conv_channels=inner + 2 * groups * state, heads=heads, head_dim=head_dim,
                     state_size=state, groups=groups)


def layer_fields(config: ModelConfig, layer: int, norm_optional: bool = False) -> list[tm.Field]:
    s, p = config.recurrent, f"blk.{layer}."
    inner = s.heads * s.head_dim
    return state_space.mixer_fields(config, layer, inner, inner + s.conv_channels + s.heads) + [
        tm.vector("ssm_dt", p + "ssm_dt.bias", (s.heads,), "attention"),
        tm.vector("ssm_a", p + "ssm_a", (1, s.heads), "attention"),
        tm.vector("ssm_d", p + "ssm_d", (1, s.heads), "attention"),
        tm.vector("ssm_norm", p + "ssm_norm.weight", (inner // s.groups, s.groups), "attention",
                  optional=norm_optional)]


def mixer(p: LayerPass, w: Weights, h: Activations) -> Activations:
    s, eps = p.config.recurrent, p.config.rms_norm_eps
    inner = s.heads * s.head_dim
    z, xbc, dt = torch.as_tensor(w.ssm_in(h)).split([inner, s.conv_channels, s.heads], dim=-1)
    dt = selective_scan.time_steps(dt + torch.as_tensor(w.ssm_dt))  # [T, H]
    a = torch.as_tensor(w.ssm_a).reshape(s.heads, 1, 1)
    y = state_space.scan(p, w, xbc, (dt,), partial(_split, s), a)  # [T, H, P]
    norm = torch.as_tensor(w.ssm_norm).reshape(-1) if "ssm_norm" in w.fields else None
    return w.ssm_out(p.kernels.take(selective_scan.gate(y.reshape(z.shape), z, norm, s.groups, eps)))


def _split(s: ScanShape, conv_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The convolution's outputs [T, D + 2 G N] -> x [T, H, P], B and C [T, G, N]."""
    tokens, groups = conv_out.shape[0], s.groups * s.state_size
    x, b, c = conv_out.split([s.heads * s.head_dim, groups, groups], dim=-1)
    return (x.reshape(tokens, s.heads, s.head_dim), b.reshape(tokens, s.groups, -1),
            c.reshape(tokens, s.groups, -1))


ARCHITECTURE = Architecture(name="mamba2", config=config, layer_fields=layer_fields,
                            block=partial(state_space.block, mixer=mixer),
                            summary="Mamba-2 state-space layers (scalar decay per head, grouped B and C, "
                                    "gated grouped RMSNorm), no attention")
