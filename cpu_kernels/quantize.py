"""Numpy encoders: float32 weights to the blocks of Q4_1, TQ3_1 and TQ2_1 (4, 3 and 2 bits).

All three formats (see `tierflow.ggml_types`) store, per group of 32 consecutive weights of a
row, a float16 scale d and offset m and one code q in 0..nmax per weight (nmax = 2^bits - 1); the
decoder computes `d * q + m` in float32. Encoding a group means choosing d and m; each code is
then the nearest level. Two methods:

- "rtn": round to nearest over the group's range, d = (max - min) / nmax and m = min, codes
  `trunc((x - min) / d + 0.5)` with the unrounded d. This is ggml's `quantize_row_q4_1_ref` at
  every bit width (bit-exact with ggml and gguf-py for Q4_1): the floor.
- "search" (default): minimises each group's squared error as the decoder sees it (float16 d and
  m). Like llama.cpp's make_qkx2_quants it tries several steps around the min/max one, from
  `(max - min) / (nmax + 1)` to `(max - min) / (nmax - 1)` (a wider step leaves headroom, a
  narrower one clips the largest weights); for each step it rounds the codes, solves the least
  squares d and m for those codes, rounds d to float16 and re-solves m for it, and keeps the pair
  with the lowest error. A few rounds of Lloyd iteration (nearest codes for the best pair, then
  least squares again) finish it. rtn's own pair is a candidate, so no group ends worse than rtn
  (up to float32 rounding in the ranking). The error is unweighted: without activation
  statistics (an importance matrix) nothing says which weights of a group matter more, and
  weighting by |x| or x^2 (llama.cpp's fallbacks) measured no better on SmolLM2's KL divergence
  at 3 bits and worse at 2 (benchmarks/quality.py).

Everything is vectorised: a tensor is encoded in chunks of groups, every candidate step of a
chunk at once, and Python loops only over chunks and Lloyd rounds. Candidates are ranked by an
error computed from per-group sums (of codes, codes squared, codes times weights), so a candidate
costs six passes over its chunk, not a decode. About 7 s for SmolLM2-135M's 106M layer weights
on one core ("rtn": 1.5 s).
"""

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from tierflow.cpu_kernels.dequant import _format_of
from tierflow.errors import InvalidArgumentError
from tierflow.ggml_types import TierflowType, type_name

GROUP = 32  # weights per block in all three formats
METHODS = ("search", "rtn")
TYPE_FOR_BITS = {4: GGMLQuantizationType.Q4_1, 3: TierflowType.TQ3_1, 2: TierflowType.TQ2_1}
_BITS_OF_TYPE = {int(t): bits for bits, t in TYPE_FOR_BITS.items()}
_HALF_MAX = 65504.0  # largest finite float16

# Steps tried by "search", as (max - min) / (nmax + delta); delta = 0 is rtn's own step.
_SEARCH_DELTAS = np.linspace(-1.0, 1.0, 11, dtype=np.float32)
_LLOYD_ROUNDS = 2
# Groups per chunk: the search's codes for all steps, [11, 32, groups] float32, take 2.8 MiB; larger
# chunks spread the per-group arithmetic's call overhead thinner, smaller ones fit cache better.
_CHUNK_GROUPS = 2048

Packer = Callable[[np.ndarray, np.ndarray], None]  # (codes [G, 32] uint8, blocks [G]) -> None
Encoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # d [G], m [G] (float16 values), codes [32, G]
Scored = tuple[np.ndarray, np.ndarray, np.ndarray]  # d, m and squared error, per group


def quantize(weights: np.ndarray, ggml_type: int, method: str = "search") -> np.ndarray:
    """Encode float32 weights [N, K] (K a multiple of 32) as blocks of `ggml_type`.

    `ggml_type` is Q4_1, TQ3_1 or TQ2_1 (see TYPE_FOR_BITS). Returns the tensor's bytes, 1-D
    uint8, blocks in row-major order: what a GGUF file holds for a tensor of shape [ne0=K, ne1=N]
    and what `dequantize(bytes, ggml_type, (K, N))` decodes. Peak memory is the output plus a
    few chunks of temporaries.
    """
    nmax, packer = _encoder(ggml_type, method)
    groups = _groups(weights)
    fmt = _format_of(ggml_type)
    blocks = np.zeros(len(groups), fmt.block_dtype)
    encode = _search if method == "search" else _rtn
    for start in range(0, len(groups), _CHUNK_GROUPS):
        out = blocks[start:start + _CHUNK_GROUPS]
        d, m, codes = encode(np.ascontiguousarray(groups[start:start + _CHUNK_GROUPS].T), nmax)
        out["d"], out["m"] = d, m
        packer(np.ascontiguousarray(codes.T, dtype=np.uint8), out)
    return blocks.view(np.uint8)


def _encoder(ggml_type: int, method: str) -> tuple[int, Packer]:
    if method not in METHODS:
        raise InvalidArgumentError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    bits = _BITS_OF_TYPE.get(int(ggml_type))
    if bits is None:
        supported = ", ".join(type_name(t) for t in TYPE_FOR_BITS.values())
        raise InvalidArgumentError(f"cannot encode {type_name(ggml_type)}; supported: {supported}")
    return (1 << bits) - 1, _PACKERS[bits]


def _groups(weights: np.ndarray) -> np.ndarray:
    """The weights as [groups, 32] float32, after checking they can be encoded at all."""
    weights = np.asarray(weights)
    if weights.ndim != 2 or weights.shape[1] % GROUP:
        raise InvalidArgumentError(
            f"weights must be 2-D with rows a multiple of {GROUP} long, got shape {weights.shape}"
        )
    weights = np.ascontiguousarray(weights, np.float32)
    if weights.size:
        largest = float(np.abs(weights).max())
        if not largest <= _HALF_MAX:  # also catches NaN
            problem = "non-finite" if not np.isfinite(largest) else f"{largest:g}, beyond float16"
            raise InvalidArgumentError(f"weights hold {problem} values; they cannot be encoded")
    return weights.reshape(-1, GROUP)


# --- encoding groups -----------------------------------------------------------------------
# A chunk is transposed to x [32, G] (G groups, weight k of every group in row k), so per-group
# sums and minima are elementwise operations across 32 rows: numpy reduces a short inner axis
# ten times slower than it adds rows.

def _half(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest float16 (ties to even), kept as float32.

    Bit arithmetic, exact for |values| < 65520 (the tests check it against astype): numpy's own
    float16 conversion is ten times slower, and it runs on every candidate of every group.
    Normal float16s keep 10 of float32's 23 fraction bits; below 2^-14 float16 is subnormal, a
    multiple of 2^-24."""
    values = np.asarray(values, np.float32)
    bits = values.view(np.uint32)
    rounded = bits + (0x0FFF + ((bits >> 13) & 1)).astype(np.uint32)
    rounded &= np.uint32(0xFFFFE000)
    subnormal = np.rint(values * np.float32(2.0**24)) * np.float32(2.0**-24)
    return np.where(np.abs(values) < np.float32(2.0**-14), subnormal, rounded.view(np.float32))


def _reciprocal(values: np.ndarray) -> np.ndarray:
    """1 / values for values >= 0; huge but finite where values is 0. (Codes multiplied by it
    only matter where d > 0; `np.divide(..., where=)` is ten times slower.)"""
    return np.float32(1) / np.maximum(values, np.float32(1e-30))


def _rtn_codes(xs: np.ndarray, d: np.ndarray, nmax: int) -> np.ndarray:
    """ggml's Q4_1 rounding: trunc(xs / d + 0.5) with xs = x - min and the float32 d."""
    inverse = np.divide(1, d, out=np.zeros_like(d), where=d != 0)  # ggml's: 0 where d is 0
    codes = xs * inverse
    codes += np.float32(0.5)
    np.trunc(codes, out=codes)
    return np.clip(codes, 0, nmax, out=codes)


def _rtn(x: np.ndarray, nmax: int) -> Encoded:
    lo = x.min(axis=0)
    d = (x.max(axis=0) - lo) / np.float32(nmax)
    return _half(d), _half(lo), _rtn_codes(x - lo, d, nmax)


def _nearest_codes(x: np.ndarray, d: np.ndarray, m: np.ndarray, nmax: int) -> np.ndarray:
    """Codes [32, G] of the levels d * q + m nearest each weight (any codes where d is 0)."""
    q = x - m
    q *= _reciprocal(d)
    np.rint(q, out=q)
    return np.clip(q, 0, nmax, out=q)


def _sums(codes: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: sum of codes, of codes squared, of codes times xs; codes [..., 32, G] -> [..., G].
    The first two are integers below 2^24, so exact in float32."""
    return (codes.sum(axis=-2), np.einsum("...kg,...kg->...g", codes, codes),
            np.einsum("...kg,kg->...g", codes, xs))


class _Groups:
    """One chunk's weights measured from each group's minimum, xs = x - lo in [0, max - min]
    (which keeps the cancellation in the error formula small), and their sums.

    Candidates are ranked by an error computed from sums in float32; its rounding error is a
    few float32 ulps of sum(xs^2), about 1e-4 of the error itself at 4 bits, so near-ties
    may be ranked either way."""

    def __init__(self, x: np.ndarray):
        self.lo = x.min(axis=0)
        self.span = x.max(axis=0) - self.lo
        self.xs = x - self.lo
        self.n = np.float32(len(x))
        self.sx = self.xs.sum(axis=0)
        self.sxx = np.einsum("kg,kg->g", self.xs, self.xs)

    def error(self, d: np.ndarray, m: np.ndarray, sl, sll, sxl) -> np.ndarray:
        """Squared error of d * codes + m per group, from the codes' sums (any leading axes)."""
        mr = m - self.lo  # the offset from the group minimum
        return d * (d * sll + 2 * (mr * sl - sxl)) + mr * (self.n * mr - 2 * self.sx) + self.sxx

    def least_squares(self, sl, sll, sxl) -> Scored:
        """The least-squares d for codes with these sums, rounded to float16, the best m for that
        d, also rounded, and their error (inf where the codes are all equal)."""
        n = self.n
        det = n * sll - sl * sl  # exact: integers below 2^24
        usable = det > 0
        d = _half((n * sxl - self.sx * sl) / np.where(usable, det, 1))
        m = _half((self.sx - d * sl) / n + self.lo)
        err = self.error(d, m, sl, sll, sxl)
        err[~usable | (d <= 0) | (d > _HALF_MAX) | (np.abs(m) > _HALF_MAX)] = np.inf
        return d, m, err


def _search(x: np.ndarray, nmax: int) -> Encoded:
    groups = _Groups(x)
    xs, span = groups.xs, groups.span
    # rtn, with its own codes: the pair every other candidate must beat.
    d_rtn = span / np.float32(nmax)
    d, m = _half(d_rtn), _half(groups.lo)
    best = d, m, groups.error(d, m, *_sums(_rtn_codes(xs, d_rtn, nmax), xs))
    # Every candidate step at once: codes [C, 32, G] for C steps.
    codes = xs * (_reciprocal(span) * (nmax + _SEARCH_DELTAS[:, None]))[:, None, :]
    np.rint(codes, out=codes)
    np.clip(codes, 0, nmax, out=codes)
    best = _better(best, _lowest(groups.least_squares(*_sums(codes, xs))))
    for _ in range(_LLOYD_ROUNDS):
        d, m, _ = best
        sums = _sums(_nearest_codes(x, d, m, nmax), xs)
        # Nearest codes can only lower the best pair's error; then refit d and m to them.
        best = _better((d, m, groups.error(d, m, *sums)), groups.least_squares(*sums))
    d, m, _ = best
    return d, m, _nearest_codes(x, d, m, nmax)


def _lowest(candidates: Scored) -> Scored:
    """Per group, the candidate (d, m, err), each [C, G], of lowest err: each [G]."""
    d, m, err = candidates
    pick = np.argmin(err, axis=0), np.arange(err.shape[1])
    return d[pick], m[pick], err[pick]


def _better(first: Scored, second: Scored) -> Scored:
    """Per group, whichever of two (d, m, err), each [G], has the lower err (first on ties)."""
    take = second[2] < first[2]
    return tuple(np.where(take, b, a) for a, b in zip(first, second))


# --- packing codes [G, 32] uint8 (0..nmax) into the blocks' fields -------------------------

_TWO_BIT_SHIFTS = np.array([0, 2, 4, 6], np.uint8)


def _pack_two_bit(q: np.ndarray) -> np.ndarray:
    """Codes [G, 32] (0..3) to qs [G, 8]: code j in bits 2*(j%4) and 2*(j%4)+1 of byte j // 4."""
    shifted = q.reshape(len(q), -1, 4) << _TWO_BIT_SHIFTS
    return np.bitwise_or.reduce(shifted, axis=2)


def _pack_q4_1(q: np.ndarray, blocks: np.ndarray) -> None:
    blocks["qs"] = q[:, :16] | (q[:, 16:] << 4)


def _pack_tq3_1(q: np.ndarray, blocks: np.ndarray) -> None:
    blocks["qh"] = np.packbits(q >> 2, axis=1, bitorder="little")
    blocks["qs"] = _pack_two_bit(q & 0x03)


def _pack_tq2_1(q: np.ndarray, blocks: np.ndarray) -> None:
    blocks["qs"] = _pack_two_bit(q)


_PACKERS: dict[int, Packer] = {4: _pack_q4_1, 3: _pack_tq3_1, 2: _pack_tq2_1}
