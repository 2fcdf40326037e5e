"""Rotary position embedding tables, with the scaling variants GGUF models use.

The formulas follow llama.cpp's rope so that tierflow matches it as an oracle: linear scaling
divides positions by the factor; YaRN blends interpolated and extrapolated frequencies with a ramp
over the "correction dimensions" and scales magnitudes by 1 + 0.1 ln(factor); some families carry
per-frequency divisors in a `rope_freqs.weight` tensor. Sliding-window layers may rotate with a
base of their own, unscaled (Gemma's local layers).
"""

import math
from dataclasses import replace

import torch

from tierflow.runtime.models.config import ModelConfig, RopeScaling

Tables = tuple[torch.Tensor, torch.Tensor]  # cos, sin, each [positions, rope_dim // 2] float32


def layer_rope_tables(config: ModelConfig, num_positions: int, freq_factors: torch.Tensor | None = None
                      ) -> list[Tables]:
    """Each layer's cos and sin tables (layers that rotate alike share them): the model's, or for
    the sliding-window layers of a model with `sliding_rope_theta`, that base without scaling
    (llama.cpp's rope_freq_base_train_swa, with rope_freq_scale_train_swa 1)."""
    shared = rope_tables(config, num_positions, freq_factors)
    if not config.sliding_rope_theta:
        return [shared] * config.num_layers
    local_config = replace(config, rope_theta=config.sliding_rope_theta, rope_scaling=RopeScaling())
    local = rope_tables(local_config, num_positions, freq_factors)
    return [local if config.window(layer) else shared for layer in range(config.num_layers)]


def rope_tables(
    config: ModelConfig, num_positions: int, freq_factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [num_positions, rope_dim // 2] float32; a model without rotary
    (rope_style "none") turns every pair by 0: cos 1 and sin 0 leave each value's bits as they are."""
    rope_dim, scaling = config.rope_dim, config.rope_scaling
    if config.rope_style == "none":
        return torch.ones(num_positions, rope_dim // 2), torch.zeros(num_positions, rope_dim // 2)
    pair_idx = torch.arange(rope_dim // 2, dtype=torch.float64)
    inv_freq = config.rope_theta ** (-2.0 * pair_idx / rope_dim)  # [R/2]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    positions = torch.arange(num_positions, dtype=torch.float64)
    extrapolated = torch.outer(positions, inv_freq)  # [P, R/2] angle without scaling
    magnitude = 1.0
    if scaling.kind == "none":
        angles = extrapolated
    elif scaling.kind == "linear":
        angles = extrapolated / scaling.factor
    else:  # yarn
        original_ctx = scaling.original_context_length or config.context_length
        low, high = _yarn_correction_range(rope_dim, original_ctx, config.rope_theta, scaling)
        ramp = 1.0 - torch.clamp((pair_idx - low) / max(0.001, high - low), 0.0, 1.0)
        angles = extrapolated / scaling.factor * (1.0 - ramp) + extrapolated * ramp
        magnitude = (1.0 + 0.1 * math.log(scaling.factor)) * scaling.attn_factor
    cos = (torch.cos(angles) * magnitude).to(torch.float32)
    sin = (torch.sin(angles) * magnitude).to(torch.float32)
    return cos, sin


def _yarn_correction_range(rope_dim: int, original_ctx: int, theta: float, scaling) -> tuple[float, float]:
    """The pair indices between which YaRN moves from extrapolation to interpolation."""

    def dim_for_rotations(num_rotations: float) -> float:
        return rope_dim * math.log(original_ctx / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = math.floor(dim_for_rotations(scaling.yarn_beta_fast))
    high = math.ceil(dim_for_rotations(scaling.yarn_beta_slow))
    return max(0.0, low), min(rope_dim - 1.0, high)
