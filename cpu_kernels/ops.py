"""The fused per-layer operations of the C extension, on float32 numpy arrays.

Each is one C call doing what several tensor operations would (see csrc/ops.c for why); the
torch formulation of each is in reference.py (the delta rule's is runtime/compute/delta_rule.py's
step_in_torch).
"""

import numpy as np

from tierflow.cpu_kernels import _kernels

DELTA_MAX_DV = _kernels.DELTA_MAX_DV  # the largest value size delta_steps takes
SCAN_MAX_N = _kernels.SCAN_MAX_N  # the largest state size scan_steps takes


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, for x [T, E]."""
    out = np.empty_like(x)
    _kernels.rms_norm(x, weight, eps, out)
    return out


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up for gate_up [T, 2F] = [gate, up] -> [T, F]."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    _kernels.silu_mul(gate_up, out)
    return out


def swiglu_oai(gate_up: np.ndarray) -> np.ndarray:
    """gpt-oss's SwiGLU (ggml's swiglu_oai) for gate_up [T, 2F] = [gate, up] -> [T, F]:
    g / (1 + exp(-1.702 g)) * (u + 1), g = min(gate, 7) and u = up clamped to [-7, 7]."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    _kernels.swiglu_oai(gate_up, out)
    return out


def weighted_rows(rows: np.ndarray, picks: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """out[t] = the sum over j of weights[t, j] * rows[picks[t, j]], j ascending, for rows [N, E]
    float32, picks [T, k] int64 (each a row of rows, else ValueError) and weights [T, k] float32:
    a MoE layer's output, each token's experts weighted in its router's order."""
    out = np.empty((picks.shape[0], rows.shape[1]), np.float32)
    _kernels.weighted_rows(rows, picks, weights, out)
    return out


def dense_matmul(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, K] @ weight.T (+ bias) for a float32 weight [N, K] (bias [N]) -> [T, N], on the kernels'
    threads. Each dot product is summed in one fixed order, so a token gets the same bits in a batch
    of any size; meant for few tokens (a decode step, a verify pass), where it reads the weight once
    for up to four tokens at a time."""
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    _kernels.dense_matmul(x, weight, bias, out)
    return out


def delta_steps(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                beta: np.ndarray, next_state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule through T tokens for every value head (runtime/compute/delta_rule.py), the heads
    on the kernels' threads: state [H, Dk, Dv], q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H],
    float32 and C-contiguous, Dv a multiple of 16 -> (outputs [T, H, Dv], the state after them,
    written into next_state when given). `state` is left as it was; every token gets the bits a
    pass of it alone would give."""
    out = np.empty(v.shape, np.float32)
    next_state = np.empty(state.shape, np.float32) if next_state is None else next_state
    _kernels.delta_steps(state, q, k, v, g, beta, out, next_state)
    return out, next_state


def scan_steps(state: np.ndarray, x: np.ndarray, dt: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray,
               d: np.ndarray, next_state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mamba's selective scan through T tokens (runtime/compute/selective_scan.py), the heads on the
    kernels' threads: state [H, P, N], x [T, H, P], dt [T, H] (after softplus), a [H, 1 or N], b, c
    [T, G, N], d [H], float32 and C-contiguous, N a multiple of 16 -> (outputs [T, H, P], the state
    after them, written into next_state when given). `state` is left as it was; every token gets the
    bits a pass of it alone would give."""
    out = np.empty(x.shape, np.float32)
    next_state = np.empty(state.shape, np.float32) if next_state is None else next_state
    _kernels.scan_steps(state, x, dt, a, b, c, d, out, next_state)
    return out, next_state


def conv_silu(history: np.ndarray, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None
              ) -> np.ndarray:
    """silu of each channel's causal convolution: history [K-1, C] (the inputs before x), x [T, C],
    weight [C, K] (tap K-1 multiplies the newest input, the taps summed in order), plus bias [C]
    where given -> [T, C]."""
    out = np.empty_like(x)
    _kernels.conv_silu(history, x, weight, bias, out)
    return out


def delta_split(conv_out: np.ndarray, key_heads: int, value_heads: int, interleaved: bool, eps: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """A DeltaNet convolution's outputs [T, C] = [queries, keys, values] -> the queries and keys
    [T, value_heads, Dk], each key head L2-normed (x / sqrt(|x|^2 + eps)) and copied to the value
    heads that read it: value head h reads key head h // (value_heads / key_heads) when
    interleaved, else h % key_heads."""
    dk = conv_out.shape[1] // (2 * key_heads + value_heads)
    q, k = (np.empty((conv_out.shape[0], value_heads, dk), np.float32) for _ in range(2))
    _kernels.delta_split(conv_out, key_heads, interleaved, eps, q, k)
    return q, k


def delta_gates(alpha: np.ndarray, beta_in: np.ndarray, dt: np.ndarray, a: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """A DeltaNet layer's decay g = softplus(alpha + dt) * a and write strength beta = sigmoid(beta_in)
    for alpha, beta_in [T, H], dt and a [H]; the functions in float64, rounded."""
    g, beta = np.empty_like(alpha), np.empty_like(alpha)
    _kernels.delta_gates(alpha, beta_in, dt, a, g, beta)
    return g, beta


def gate_group_norm(y: np.ndarray, z: np.ndarray, weight: np.ndarray | None, groups: int, eps: float
                    ) -> np.ndarray:
    """Mamba's gate: y * silu(z) for y and z [R, N]; with weight [N], each group of N / groups
    channels then rms-normed and times its weights (Mamba-2's ssm_norm)."""
    out = np.empty_like(y)
    _kernels.gate_group_norm(y, z, weight, groups, eps, out)
    return out


def gated_rms_norm(x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm(x) * weight * silu(gate) for x and gate [R, N], weight [N]."""
    out = np.empty_like(x)
    _kernels.gated_rms_norm(x, weight, gate, eps, out)
    return out


def attention(qkv: np.ndarray, keys: np.ndarray, values: np.ndarray, cos: np.ndarray, sin: np.ndarray,
              heads: int, start: int, neox: bool, parents: np.ndarray | None = None,
              tree_start: int | None = None, window: int = 0, scale: float | None = None,
              softcap: float = 0.0, held_from: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of T new tokens at cache positions start .. start + T - 1.

    qkv [T, (H + 2K) * D] (rotated in place; with a quantized cache, Hadamard-rotated too, the
    values included: hadamard.py); keys [K, C/16, I, 16] and values [K, C, I], one
    layer's cache in any of its types (rows of I items, keys transposed in blocks of 16 positions:
    kv_layout.py), into which the tokens' keys and values are written in that type before any is
    read; cos, sin [T, R/2].
    Token i sees cache positions 0 .. start + i; query head h uses key/value head h // (H / K).
    With parents the tokens extend a token tree begun at slot tree_start (default: start), maybe
    in earlier calls: parents (int32 [start - tree_start + T]) holds each tree token's parent, -1
    or an earlier one. A tree token sees positions 0 .. tree_start - 1 and its ancestors, and gets
    the same bits as if decoded right after them (its rotary rows in cos, sin are those of
    position tree_start + its depth).
    Scores q.k are multiplied by scale (default D ** -0.5), then with softcap > 0 become
    softcap * tanh(score / softcap); with window > 0 the token at position p sees positions
    p - window + 1 .. p only (a tree token's position being tree_start + its depth).
    Position p is in slot p % C: with a window and a longer context the cache is a ring, which
    must hold the window before the pass and its tokens (kv_types.scored_slots <= C; else
    ValueError). No token sees a position before held_from (the oldest the cache still holds).
    sinks (float32 [H]) are attention sinks: one more logit per query head in its softmax, which
    takes a share of the probability and adds no value (gpt-oss).
    Returns [T, H * D].
    """
    head_dim = qkv.shape[1] // (heads + 2 * keys.shape[0])
    out = np.empty((qkv.shape[0], heads * head_dim), np.float32)
    _kernels.attention(qkv, keys, values, cos, sin, out, heads, start, 2 * cos.shape[-1], neox,
                       head_dim**-0.5 if scale is None else scale, parents,
                       start if tree_start is None else tree_start, window, softcap, held_from, sinks)
    return out
