"""The gated delta rule, Gated DeltaNet's recurrence, in float32: token by token and chunked.

Per value head, with a state S [Dk, Dv], a token's query q and key k (L2-normed, [Dk]), value v
[Dv], decay g (<= 0) and write strength beta in (0, 1):
    S <- S * exp(g)
    S <- S + k (beta (v - k^T S))^T      (the delta rule: move k's read-out towards v)
    o  = q^T S / sqrt(Dk)
`stepwise` runs it one token at a time: on the CPU in one call of the C kernels for all the tokens
(each head's state stays in the core's cache), elsewhere as torch operations per token
(`step_in_torch`). `chunked` runs a prompt in chunks of CHUNK tokens, each a few torch matrix
products (the WY form llama.cpp and the reference implementation use), so that a long prompt on a
GPU costs matrix products rather than a Python loop per token; `long_pass` picks the faster of the
two for a prefill chunk. They give the same result up to float rounding; token trees and draft
verification use `step`, so their rows are bit for bit what decoding the tokens one by one gives.
Before it, `gates` computes the tokens' decays and strengths, `causal_conv` the short causal
convolution, `split_heads` the normed queries and keys of each value head. Each of these is one C
call on the CPU (cpu_kernels.ops: a decode step's layer would otherwise be some forty small torch
operations) and torch elsewhere (the `*_in_torch` forms, which the C kernels are tested against);
every element's bits are the same in a pass of any length.

Shapes: T tokens, H value heads, Dk key size, Dv value size, C channels, K kernel taps.
"""

import sys

import numpy as np
import torch
import torch.nn.functional as F

from tierflow.cpu_kernels import ops

CHUNK = 32  # tokens per chunk of the chunked form (llama.cpp's 64 took 20% longer on the CPU)


def same_bits(function, x: torch.Tensor) -> torch.Tensor:
    """function(x) computed in float64 and rounded to x's float32: the same bits for an element
    whatever the tensor's size. torch computes transcendental functions with vector code and the
    elements left over with scalar code, which can differ in the last bit; both round alike from
    float64. Decoding one token and verifying many must give a token's row bit for bit."""
    return function(x.double()).to(x.dtype)


def causal_conv(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """silu of each channel's causal convolution (plus its bias, where given: Mamba's): history
    [K-1, C] (the inputs before x), x [T, C], weight [C, K] (tap K-1 multiplies the newest input),
    bias [C] -> [T, C]. One C call on the CPU."""
    if x.device.type == "cpu":
        arrays = [t.contiguous().numpy() for t in (history, x, weight)]
        return torch.from_numpy(ops.conv_silu(*arrays, None if bias is None else bias.contiguous().numpy()))
    return causal_conv_in_torch(history, x, weight, bias)


def causal_conv_in_torch(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_conv` as torch operations, on any device: the taps summed oldest first, then the
    bias, as ggml_ssm_conv and its add."""
    window = torch.cat([history, x])  # [K-1+T, C]
    taps = weight.shape[1]
    out = sum(window[j:j + x.shape[0]] * weight[:, j] for j in range(taps))
    return same_bits(F.silu, out if bias is None else out + bias)


def gates(alpha: torch.Tensor, beta_in: torch.Tensor, dt: torch.Tensor, a: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay g = softplus(alpha + dt) * a and the write strength beta = sigmoid(beta_in), for
    alpha, beta_in [T, H] and dt, a [H] (a < 0: g <= 0). One C call on the CPU."""
    if alpha.device.type == "cpu":
        g, beta = ops.delta_gates(*(t.contiguous().numpy() for t in (alpha, beta_in, dt, a)))
        return torch.from_numpy(g), torch.from_numpy(beta)
    return gates_in_torch(alpha, beta_in, dt, a)


def gates_in_torch(alpha: torch.Tensor, beta_in: torch.Tensor, dt: torch.Tensor, a: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gates` as torch operations, on any device."""
    return same_bits(F.softplus, alpha + dt) * a, same_bits(torch.sigmoid, beta_in)


def split_heads(conv_out: torch.Tensor, key_heads: int, value_heads: int, interleaved: bool, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's outputs [T, C] = [queries, keys, values] -> each value head's query and key
    ([T, H, Dk], L2-normed: x / sqrt(|x|^2 + eps), as llama.cpp's ggml_l2_norm) and its value
    [T, H, Dv]. Value head h reads key head h // (H / key heads) when interleaved, else h % key heads
    (ggml_repeat's tiling). One C call on the CPU."""
    tokens, dk = conv_out.shape[0], conv_out.shape[1] // (2 * key_heads + value_heads)
    v = conv_out[:, 2 * key_heads * dk:].reshape(tokens, value_heads, -1)
    if conv_out.device.type == "cpu":
        q, k = ops.delta_split(conv_out.contiguous().numpy(), key_heads, value_heads, interleaved, eps)
        return torch.from_numpy(q), torch.from_numpy(k), v
    return (*split_heads_in_torch(conv_out, key_heads, value_heads, interleaved, eps), v)


def split_heads_in_torch(conv_out: torch.Tensor, key_heads: int, value_heads: int, interleaved: bool,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_heads`'s queries and keys as torch operations, on any device."""
    tokens, dk = conv_out.shape[0], conv_out.shape[1] // (2 * key_heads + value_heads)
    # contiguous, so that each row's norm is summed alike whatever the pass's token count
    queries_keys = conv_out[:, :2 * key_heads * dk].reshape(tokens, 2, key_heads, dk)
    q, k = (x.contiguous() for x in queries_keys.unbind(1))
    q, k = (x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps) for x in (q, k))
    shared = value_heads // key_heads
    q, k = (x.repeat_interleave(shared, dim=1) if interleaved else x.repeat(1, shared, 1) for x in (q, k))
    return q, k


def on_kernels(state: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C kernels run the recurrence (cpu_kernels.ops.delta_steps): on the CPU, for the
    value sizes they take (a multiple of 16, at most ops.DELTA_MAX_DV)."""
    size = v.shape[-1]
    return state.device.type == "cpu" and size % 16 == 0 and size <= ops.DELTA_MAX_DV


class StateBuffers:
    """Arrays for the states the C kernels write, recycled: a decode step makes each layer a new state
    (2 MB at Qwen3.5's shape), and fresh arrays of that size came from pages the allocator had just
    handed back to the system, about a thousand page faults a step and a tenth of its time
    (diagnostic). An array is taken again once nothing but this holds it: no tensor views it any
    more. At most `limit` arrays are kept (those beyond are allocated and let go as before)."""

    def __init__(self, limit: int):
        self._arrays: list[np.ndarray] = []
        self._limit = limit

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        for array in self._arrays:
            # referred to by the list, this loop and getrefcount's argument only
            if sys.getrefcount(array) == 3 and array.shape == shape:
                return array
        array = np.empty(shape, np.float32)
        if len(self._arrays) < self._limit:
            self._arrays.append(array)
        return array


def step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor, buffers: StateBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state [H, Dk, Dv], q, k [H, Dk], v [H, Dv], g, beta [H] -> (output [H, Dv], new state)."""
    out, state = stepwise(state, q[None], k[None], v[None], g[None], beta[None], buffers)
    return out[0], state


def stepwise(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, buffers: StateBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`step` over T tokens in order: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H] -> ([T, H, Dv], state).
    On the kernels one C call, which gives each token the bits a pass of it alone gives (and took a
    third of step_in_torch's time a token, and 60% of the chunked form's over a 4096-token prompt),
    the new state in an array of `buffers` when given; elsewhere step_in_torch, token by token."""
    if not len(q):
        return v.new_empty((0, *v.shape[1:])), state
    if on_kernels(state, v):
        next_state = buffers.take(tuple(state.shape)) if buffers is not None else None
        out, state = ops.delta_steps(*(x.contiguous().numpy() for x in (state, q, k, v, g, beta)), next_state)
        return torch.from_numpy(out), torch.from_numpy(state)
    outs = []
    for t in range(q.shape[0]):
        out, state = step_in_torch(state, q[t], k[t], v[t], g[t], beta[t])
        outs.append(out[None])
    return torch.cat(outs), state


def step_in_torch(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`step` as torch operations, on any device."""
    # Both reads from the state before it decays, in one product: k^T S and q^T S, then
    # S' = exp(g) S + k delta^T gives k^T S' = exp(g) k^T S + ... and q^T S' = exp(g) q^T S + (q . k) delta.
    decay = torch.exp(g)
    reads = torch.bmm(torch.stack([k, q], dim=1), state) * decay[:, None, None]  # [H, 2, Dv]
    delta = (v - reads[:, 0]) * beta[:, None]
    out = (reads[:, 1] + (q * k).sum(-1, keepdim=True) * delta) * q.shape[-1] ** -0.5
    state = (state * decay[:, None, None]).baddbmm_(k[:, :, None], delta[:, None, :])
    return out, state


def long_pass(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, buffers: StateBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's recurrence, as `stepwise`: the kernels' token loop where they run it (faster
    there than the chunked form's small products), else the chunked form."""
    if on_kernels(state, v):
        return stepwise(state, q, k, v, g, beta, buffers)
    return chunked(state, q, k, v, g, beta)


def chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `stepwise`, CHUNK tokens at a time. Within a chunk, with G the cumulative decay,
    the tokens' corrections solve one triangular system, (I + A) U = beta (v - decayed reads of the
    state), A[i, j] = beta_i exp(G_i - G_j) k_i . k_j for j < i; the outputs are the decayed reads
    of the state plus the causal, decayed q . k mix of U; the state decays by the chunk's total and
    takes every token's k U^T, each decayed from its position to the chunk's end."""
    tokens, heads, dk = k.shape
    dv, pad, chunk = v.shape[-1], -tokens % CHUNK, CHUNK

    def blocks(x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] -> [N, H, CHUNK, ...], each chunk's block contiguous: padding has k = v = 0 and
        g = 0, so it neither reads nor writes nor decays."""
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad) if x.dim() == 3 else (0, 0, 0, pad))
        x = x.reshape(-1, chunk, *x.shape[1:]).transpose(1, 2)
        return x.contiguous()

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    chunks = q.shape[0]
    decays = g.cumsum(-1)  # [N, H, CHUNK]: G, the decay from the chunk's start to each token
    growth = torch.exp(decays)[..., None]
    # exp(G_i - G_j) where j <= i, else 0 (tril_ drops the entries above, whatever exp made of them)
    decay_mask = torch.exp(decays[..., :, None] - decays[..., None, :]).tril_()
    # beta k and the scaled queries against the keys in one product: [N, H, 2 CHUNK, CHUNK]
    left = torch.empty(chunks, heads, 2 * chunk, dk, dtype=k.dtype, device=k.device)
    torch.mul(k, beta[..., None], out=left[..., :chunk, :])
    torch.mul(q, dk ** -0.5, out=left[..., chunk:, :])
    scores = left @ k.transpose(-1, -2)
    strict = scores[..., :chunk, :].mul_(decay_mask).tril_(-1)  # A
    mixes = scores[..., chunk:, :].mul_(decay_mask)  # the decayed q . k, causal
    # (I + A) [U0 | W] = [beta v | beta k exp(G)]: one triangular solve for both right-hand sides
    rhs = torch.empty(chunks, heads, chunk, dv + dk, dtype=k.dtype, device=k.device)
    torch.mul(v, beta[..., None], out=rhs[..., :dv])
    torch.mul(left[..., :chunk, :], growth, out=rhs[..., dv:])
    identity = torch.eye(chunk, dtype=k.dtype, device=k.device).expand_as(strict)
    solved = torch.linalg.solve_triangular(strict, identity, upper=False, unitriangular=True) @ rhs
    values = solved[..., :dv]
    # what reads the state, per chunk in one product: the corrections' and the outputs' readers
    readers = torch.empty(chunks, heads, 2 * chunk, dk, dtype=k.dtype, device=k.device)
    readers[..., :chunk, :] = solved[..., dv:]
    torch.mul(left[..., chunk:, :], growth, out=readers[..., chunk:, :])
    last = decays[..., -1]  # [N, H]: each chunk's total decay
    to_end = (k * torch.exp(last[..., None] - decays)[..., None]).transpose(-1, -2)  # keys decayed to the end
    out = torch.empty(chunks, heads, chunk, dv, dtype=v.dtype, device=v.device)
    for i in range(chunks):
        read = readers[i] @ state  # [H, 2 CHUNK, Dv]
        corrections = values[i] - read[:, :chunk]  # U
        torch.baddbmm(read[:, chunk:], mixes[i], corrections, out=out[i])
        state = torch.baddbmm(state * torch.exp(last[i])[:, None, None], to_end[i], corrections)
    return out.transpose(1, 2).reshape(-1, heads, dv)[:tokens], state
