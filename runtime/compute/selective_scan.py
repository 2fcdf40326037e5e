"""Mamba's selective scan (llama.cpp's ggml_ssm_scan), in float32, token by token.

Per head h of P channels, with a state S [P, N], a token's x [P] (the convolution's output), its
time step dt (after softplus, > 0), the B and C [N] of the head's group, the decay A (Mamba-1: one
per state element of each channel, every channel a head of one; Mamba-2: one per head) and the skip D:
    S <- S * exp(dt A) + (x dt) B^T
    y  = S C + D x
`steps` runs it over T tokens with the same operations for each token whatever T, so that decoding,
verification and a token tree give a token the same bits: on the CPU one call of the C kernels
(cpu_kernels.ops.scan_steps, each head's state kept in the core's cache across the tokens), elsewhere
torch operations per token (`steps_in_torch`). `long_pass` runs a prefill chunk: on the CPU the
kernels' token loop, faster there than the chunked forms (2,048 tokens of a Mamba-2 layer of
Granite-4.0-H-Micro's shape: 166 ms against dual_blocks' 450, on 2 cores); elsewhere in chunks of
tokens, each a few batched tensor operations rather than a Python step per token (the same up to
float rounding): Mamba-2's as state-space duality's matrix products (`dual_blocks`), Mamba-1's by
recursive doubling (`doubling_blocks`).

Shapes: T tokens, H heads, P head size, N state size, G groups (head h reads group h // (H / G)),
L tokens in a chunk.
"""

import torch
import torch.nn.functional as F

from tierflow.cpu_kernels import ops
from tierflow.runtime.compute.delta_rule import StateBuffers, same_bits

DUAL_CHUNK = 64  # tokens per block of Mamba-2's chunked form
SCAN_CHUNK = 16  # Mamba-1's: on 2 cores, 512 tokens of 1536 channels took half the token loop's time


def time_steps(dt: torch.Tensor) -> torch.Tensor:
    """softplus(dt), [T, H]: ggml's softplus, x itself above 20, as torch's."""
    return same_bits(F.softplus, dt)


def on_kernels(state: torch.Tensor) -> bool:
    """Whether the C kernels run the scan (cpu_kernels.ops.scan_steps): on the CPU, for the state
    sizes they take (a multiple of 16, at most ops.SCAN_MAX_N)."""
    size = state.shape[-1]
    return state.device.type == "cpu" and size % 16 == 0 and size <= ops.SCAN_MAX_N


def steps(a: torch.Tensor, d: torch.Tensor, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
          c: torch.Tensor, dt: torch.Tensor, buffers: StateBuffers | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over T tokens in order: a [H, 1, N] or [H, 1, 1] (negative), d [H], state [H, P, N],
    x [T, H, P], b, c [T, G, N], dt [T, H] -> (y [T, H, P], the state after the last token). On the
    kernels one C call, the new state in an array of `buffers` when given; elsewhere
    `steps_in_torch`."""
    if on_kernels(state):
        next_state = buffers.take(tuple(state.shape)) if buffers is not None else None
        arrays = (state, x, dt, a.reshape(a.shape[0], -1), b, c, d)
        out, state = ops.scan_steps(*(t.contiguous().numpy() for t in arrays), next_state)
        return torch.from_numpy(out), torch.from_numpy(state)
    return steps_in_torch(a, d, state, x, b, c, dt)


def steps_in_torch(a: torch.Tensor, d: torch.Tensor, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` as torch operations, on any device."""
    heads, groups = state.shape[0], b.shape[1]
    b, c = (t.repeat_interleave(heads // groups, dim=1)[:, :, None, :] for t in (b, c))  # [T, H, 1, N]
    decays = same_bits(torch.exp, dt[:, :, None, None] * a)  # [T, H, 1, N or 1]
    scaled = (x * dt[:, :, None])[..., None]  # [T, H, P, 1]; each token's write, scaled * b[t], is a
    outs = []  # state's size, so it is made as the token's step runs, not for all T at once
    for t in range(x.shape[0]):
        state = state * decays[t] + scaled[t] * b[t]
        outs.append((state * c[t]).sum(-1))
    return torch.stack(outs) + x * d[:, None], state


def long_pass(a: torch.Tensor, d: torch.Tensor, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
              c: torch.Tensor, dt: torch.Tensor, buffers: StateBuffers | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's scan, as `steps` up to float rounding: the kernels' token loop where they
    run it; elsewhere Mamba-2's (a scalar decay per head) in the state-space-duality blocks of
    `dual_blocks`, Mamba-1's (a decay per state element) in the chunked scan of `doubling_blocks`."""
    if on_kernels(state):
        return steps(a, d, state, x, b, c, dt, buffers)
    return chunked(a, d, state, x, b, c, dt)


def chunked(a: torch.Tensor, d: torch.Tensor, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
            c: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan in chunks of tokens: `dual_blocks` for Mamba-2's scalar decays, `doubling_blocks` for
    Mamba-1's per-element ones."""
    return (dual_blocks if a.shape[-1] == 1 else doubling_blocks)(a, d, state, x, b, c, dt)


def gate(y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor | None = None, groups: int = 1,
         eps: float = 0.0) -> torch.Tensor:
    """The mixer's output gate after the scan, y * silu(z) [T, D]; with norm_weight [D] (Mamba-2's
    ssm_norm), each of `groups` groups of channels then RMS-normed and times its weights. One C call
    on the CPU; elsewhere `gate_in_torch`."""
    if y.device.type == "cpu":
        arrays = [t.contiguous().numpy() for t in (y, z)]
        weight = None if norm_weight is None else norm_weight.contiguous().numpy()
        return torch.from_numpy(ops.gate_group_norm(*arrays, weight, groups, eps))
    return gate_in_torch(y, z, norm_weight, groups, eps)


def gate_in_torch(y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor | None = None, groups: int = 1,
                  eps: float = 0.0) -> torch.Tensor:
    """`gate` as torch operations, on any device: the squares summed in double precision, then
    x * (1 / sqrt(mean + eps)), as ggml_rms_norm."""
    gated = y * same_bits(F.silu, z)
    if norm_weight is None:
        return gated
    parts = gated.reshape(gated.shape[0], groups, -1)
    mean = parts.double().square().mean(-1, keepdim=True).to(gated.dtype)
    return (parts * (1.0 / torch.sqrt(mean + eps))).reshape(gated.shape) * norm_weight


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[T, ...] -> [T / size, size, ...], zeros padding the last block: a padded token has dt = 0, so
    it neither decays nor writes the state."""
    pad = -x.shape[0] % size
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.reshape(-1, size, *x.shape[1:])


def dual_blocks(a: torch.Tensor, d: torch.Tensor, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan (a [H, 1, 1]), DUAL_CHUNK tokens at a time, as state-space duality's matrix
    products. Within a chunk, with Λ_i = Σ_{k<=i} dt_k a the cumulative log-decay (<= 0, falling),
        y_i = Σ_{j<=i} exp(Λ_i - Λ_j) (c_i . b_j) (x_j dt_j) + exp(Λ_i) S c_i + D x_i
        S  <- exp(Λ_L) S + Σ_j exp(Λ_L - Λ_j) (x_j dt_j) b_j^T
    the first sum one [L, L] x [L, P] product per head, the causal mask's exponents all <= 0 (those
    above the diagonal are -inf before exp, never large and positive)."""
    tokens, heads, head_dim = x.shape
    groups, shared = b.shape[1], heads // b.shape[1]
    # C chunks of L tokens; heads as [G, H / G] so that B and C are never repeated per head. Λ is
    # summed, and its differences taken, in float64: float32's would lose exp(Λ_i - Λ_j)'s digits to
    # cancellation once a chunk's decay runs to hundreds
    log_decays = _blocks(dt.double() * a.reshape(heads), DUAL_CHUNK).cumsum(1).transpose(1, 2)  # Λ [C, H, L]
    scaled = _blocks(x * dt[..., None], DUAL_CHUNK).permute(0, 2, 1, 3)  # x dt [C, H, L, P]
    b, c = (_blocks(t, DUAL_CHUNK).transpose(1, 2) for t in (b, c))  # [C, G, L, N]
    mask = (log_decays[..., :, None] - log_decays[..., None, :]).to(x.dtype)
    mask.masked_fill_(_above_diagonal(x.device), -torch.inf)
    mixes = (c @ b.transpose(-1, -2))[:, :, None] * mask.exp_().unflatten(1, (groups, shared))
    within = mixes @ scaled.unflatten(1, (groups, shared))  # [C, G, H / G, L, P]
    from_start = log_decays.exp().to(x.dtype)[..., None].unflatten(1, (groups, shared))  # exp(Λ_i)
    totals = log_decays[..., -1:]  # Λ_L [C, H, 1]
    # each token's x dt decayed to the chunk's end
    writes = scaled * (totals - log_decays).exp().to(x.dtype)[..., None]
    totals = totals.exp().to(x.dtype)
    state = state.unflatten(0, (groups, shared))  # [G, H / G, P, N]
    for i in range(len(within)):
        within[i] += from_start[i] * (c[i, :, None] @ state.transpose(-1, -2))
        state = state * totals[i].reshape(groups, shared, 1, 1) \
            + writes[i].unflatten(0, (groups, shared)).transpose(-1, -2) @ b[i, :, None]
    out = within.flatten(1, 2).permute(0, 2, 1, 3).reshape(-1, heads, head_dim)[:tokens]
    return out + x * d[:, None], state.flatten(0, 1)


def doubling_blocks(a: torch.Tensor, d: torch.Tensor, state: torch.Tensor, x: torch.Tensor,
                    b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1's scan (a [H, 1, N], heads of one channel), SCAN_CHUNK tokens at a time. A decay per
    state element leaves no matrix product, so each chunk's states are found by recursive doubling
    (Hillis and Steele, `_doubling`): after the step of stride s, token i holds
    Σ_{i-2s<j<=i} exp(Λ_i - Λ_j) w_j of the writes w_j = x_j dt_j b_j, the sum of the s tokens
    before it joining its own decayed by those s tokens' log-decays, summed alike (Λ the cumulative
    log-decay); log2(L) steps of a few tensor operations rather than L, and no exponent above 0.
    Then the chunk's start state, decayed by exp(Λ_i), joins every token's, and y_i = S_i c_i + D x_i."""
    tokens, heads, _ = x.shape
    state = state[:, 0]  # [H, N]
    log_decays = _blocks(dt[..., None] * a[:, 0], SCAN_CHUNK)  # dt a [C, L, H, N]
    writes = _blocks((x * dt[..., None]) * b, SCAN_CHUNK)  # [C, L, H, N]
    readers = _blocks(c, SCAN_CHUNK)  # [C, L, 1, N]
    outs = []
    for chunk in range(len(writes)):
        within, decayed = _doubling(writes[chunk], log_decays[chunk])
        states = within + decayed.exp() * state  # S_i [L, H, N]
        outs.append((states * readers[chunk]).sum(-1))
        state = states[-1]
    out = torch.cat(outs)[:tokens, :, None]
    return out + x * d[:, None], state[:, None]


def _doubling(writes: torch.Tensor, log_decays: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's writes w and log-decays l [L, ...] -> each token's Σ_{j<=i} exp(Λ_i - Λ_j) w_j and Λ_i,
    by recursive doubling. Λ_i - Λ_{i-s} is summed over its own window, never the difference of
    two cumulative sums, which float32 would lose to cancellation once a chunk's decay is large."""
    writes, log_decays = writes.clone(), log_decays.clone()
    stride = 1
    while stride < len(writes):
        writes[stride:] += writes[:-stride] * log_decays[stride:].exp()  # decayed by the s tokens up to i
        log_decays[stride:] += log_decays[:-stride].clone()
        stride *= 2
    return writes, log_decays


def _above_diagonal(device: torch.device) -> torch.Tensor:
    """[L, L], true where j > i: the tokens after i, which a causal mask drops."""
    return torch.ones(DUAL_CHUNK, DUAL_CHUNK, dtype=torch.bool, device=device).triu_(1)
