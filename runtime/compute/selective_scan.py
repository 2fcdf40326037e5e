"""Mamba's selective scan (llama.cpp's ggml_ssm_scan), in float32, token by token.

Per head h of P channels, with a state S [P, N], a token's x [P] (the convolution's output), its
time step dt (after softplus, > 0), the B and C [N] of the head's group, the decay A (Mamba-1: one
per state element of each channel, every channel a head of one; Mamba-2: one per head) and the skip D:
    S <- S * exp(dt A) + (x dt) B^T
    y  = S C + D x
`steps` runs it over T tokens with the same operations for each token whatever T, so that decoding,
verification and a prompt give a token the same bits; a prompt runs it too (the chunked form of
Mamba-2's state-space duality is still to come).

Shapes: T tokens, H heads, P head size, N state size, G groups (head h reads group h // (H / G)).
"""

import torch
import torch.nn.functional as F

from tierflow.runtime.compute.delta_rule import StateBuffers, same_bits


def time_steps(dt: torch.Tensor) -> torch.Tensor:
    """softplus(dt), [T, H]: ggml's softplus, x itself above 20, as torch's."""
    return same_bits(F.softplus, dt)


def steps(a: torch.Tensor, d: torch.Tensor, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
          c: torch.Tensor, dt: torch.Tensor, buffers: StateBuffers | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over T tokens in order: a [H, 1, N] or [H, 1, 1] (negative), d [H], state [H, P, N],
    x [T, H, P], b, c [T, G, N], dt [T, H] -> (y [T, H, P], the state after the last token).
    `buffers` are the C kernels' recycled arrays, which the scan, in torch, leaves unused."""
    heads, groups = state.shape[0], b.shape[1]
    b, c = (t.repeat_interleave(heads // groups, dim=1)[:, :, None, :] for t in (b, c))  # [T, H, 1, N]
    decays = same_bits(torch.exp, dt[:, :, None, None] * a)  # [T, H, 1, N or 1]
    scaled = (x * dt[:, :, None])[..., None]  # [T, H, P, 1]; each token's write, scaled * b[t], is a
    outs = []  # state's size, so it is made as the token's step runs, not for all T at once
    for t in range(x.shape[0]):
        state = state * decays[t] + scaled[t] * b[t]
        outs.append((state * c[t]).sum(-1))
    return torch.stack(outs) + x * d[:, None], state
