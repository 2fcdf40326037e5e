"""The gated delta rule, Gated DeltaNet's recurrence, in float32 torch: token by token and chunked.

Per value head, with a state S [Dk, Dv], a token's query q and key k (L2-normed, [Dk]), value v
[Dv], decay g (<= 0) and write strength beta in (0, 1):
    S <- S * exp(g)
    S <- S + k (beta (v - k^T S))^T      (the delta rule: move k's read-out towards v)
    o  = q^T S / sqrt(Dk)
`step` runs it one token at a time; `chunked` runs a prompt in chunks of CHUNK tokens, each a few
matrix products (the WY form llama.cpp and the reference implementation use), so a long prompt
costs matrix products rather than a Python loop per token. Both give the same result up to float
rounding; token trees and draft verification use `step`, so their rows are bit for bit what decoding
the tokens one by one gives. `causal_conv` is the short causal convolution before it.

Shapes: T tokens, H value heads, Dk key size, Dv value size, C channels, K kernel taps.
"""

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (llama.cpp's)


def same_bits(function, x: torch.Tensor) -> torch.Tensor:
    """function(x) computed in float64 and rounded to x's float32: the same bits for an element
    whatever the tensor's size. torch computes transcendental functions with vector code and the
    elements left over with scalar code, which can differ in the last bit; both round alike from
    float64. Decoding one token and verifying many must give a token's row bit for bit."""
    return function(x.double()).to(x.dtype)


def causal_conv(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu of each channel's causal convolution: history [K-1, C] (the inputs before x), x [T, C],
    weight [C, K] (tap K-1 multiplies the newest input) -> [T, C]."""
    window = torch.cat([history, x])  # [K-1+T, C]
    taps = weight.shape[1]
    out = sum(window[j:j + x.shape[0]] * weight[:, j] for j in range(taps))
    return same_bits(F.silu, out)


def step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state [H, Dk, Dv], q, k [H, Dk], v [H, Dv], g, beta [H] -> (output [H, Dv], new state)."""
    state = state * torch.exp(g)[:, None, None]
    read = torch.einsum("hkv,hk->hv", state, k)
    delta = (v - read) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    out = torch.einsum("hkv,hk->hv", state, q) * q.shape[-1] ** -0.5
    return out, state


def stepwise(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`step` over T tokens in order: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H] -> ([T, H, Dv], state)."""
    outs = []
    for t in range(q.shape[0]):
        out, state = step(state, q[t], k[t], v[t], g[t], beta[t])
        outs.append(out)
    return torch.stack(outs), state


def chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `stepwise`, CHUNK tokens at a time. Within a chunk, with G the cumulative decay,
    the tokens' corrections solve one triangular system, (I + A) U = beta (v - decayed reads of the
    state), A[i, j] = beta_i exp(G_i - G_j) k_i . k_j for j < i; the outputs are the decayed reads
    of the state plus the causal, decayed q . k mix of U; the state decays by the chunk's total and
    takes every token's k U^T, each decayed from its position to the chunk's end."""
    tokens, heads, dk = k.shape
    pad = -tokens % CHUNK
    # [H, N, CHUNK, D]: padding has k = v = 0 and g = 0, so it neither reads nor writes nor decays
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, CHUNK, x.shape[-1])
               for x in (q * dk ** -0.5, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)).reshape(heads, -1, CHUNK) for x in (g, beta))
    decays = g.cumsum(-1)  # [H, N, CHUNK]: G, the decay from the chunk's start to each token
    relative = (decays[..., :, None] - decays[..., None, :]).tril()  # G_i - G_j where j <= i
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).tril()
    decay_mask = torch.exp(relative) * lower
    k_beta = k * beta[..., None]
    off_diagonal = ~torch.eye(CHUNK, dtype=torch.bool, device=k.device)
    strict = (k_beta @ k.transpose(-1, -2)) * decay_mask * off_diagonal
    identity = torch.eye(CHUNK, dtype=k.dtype, device=k.device).expand_as(strict)
    solve = torch.linalg.solve_triangular(identity + strict, identity, upper=False)  # (I + A)^-1
    values = solve @ (v * beta[..., None])  # [H, N, CHUNK, Dv]
    key_decays = solve @ (k_beta * torch.exp(decays)[..., None])  # [H, N, CHUNK, Dk]
    mixes = (q @ k.transpose(-1, -2)) * decay_mask  # [H, N, CHUNK, CHUNK]
    outs = []
    for i in range(q.shape[1]):
        corrections = values[:, i] - key_decays[:, i] @ state  # U [H, CHUNK, Dv]
        reads = (q[:, i] * torch.exp(decays[:, i])[..., None]) @ state
        outs.append(reads + mixes[:, i] @ corrections)
        last = decays[:, i, -1]  # [H]
        to_end = torch.exp(last[:, None] - decays[:, i])[..., None]  # [H, CHUNK, 1]
        state = state * torch.exp(last)[:, None, None] + (k[:, i] * to_end).transpose(-1, -2) @ corrections
    out = torch.cat(outs, dim=1)[:, :tokens]  # [H, T, Dv]
    return out.transpose(0, 1), state
