"""Mamba's selective scan (runtime/compute/selective_scan.py): a prefill chunk's chunked form
(`long_pass`: Mamba-2's state-space-duality blocks, Mamba-1's recursive doubling) against the token
loop (`steps`), from a nonzero state, over passes shorter than a chunk, of whole chunks and between
them; and the budget's estimate of what a pass holds (ScanShape.pass_bytes)."""

import pytest
import torch

from tierflow.runtime.compute.selective_scan import DUAL_CHUNK, SCAN_CHUNK, long_pass, steps
from tierflow.runtime.memory.state_shapes import ScanShape

# (heads, head size, state size, groups, decay per state element): Mamba-2's and Mamba-1's layouts
MAMBA2, MAMBA1 = (8, 16, 32, 2, False), (24, 1, 16, 1, True)


def scan_inputs(tokens: int, heads: int, head_dim: int, state_size: int, groups: int, per_element: bool,
                decay: float = 1.0) -> tuple[torch.Tensor, ...]:
    """a (negative, up to -`decay` - 0.1 per unit of dt), d, a nonzero state and T tokens' x, B, C
    and time steps in (0, 1)."""
    generator = torch.Generator().manual_seed(tokens)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    a = -torch.rand(heads, 1, state_size if per_element else 1, generator=generator) * decay - 0.1
    return (a, normal(heads), normal(heads, head_dim, state_size), normal(tokens, heads, head_dim),
            normal(tokens, groups, state_size), normal(tokens, groups, state_size),
            torch.rand(tokens, heads, generator=generator))


def lengths(chunk: int) -> list[int]:
    return [1, 7, chunk - 1, chunk, chunk + 1, 3 * chunk + 5]


@pytest.mark.parametrize("layout, tokens", [(MAMBA2, t) for t in lengths(DUAL_CHUNK)]
                         + [(MAMBA1, t) for t in lengths(SCAN_CHUNK)])
def test_the_chunked_scan_gives_the_token_loops_outputs_and_state_up_to_float_rounding(layout, tokens):
    inputs = scan_inputs(tokens, *layout)
    expected_out, expected_state = steps(*inputs)
    out, state = long_pass(*inputs)
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [MAMBA2, MAMBA1])
def test_strong_decays_leave_the_chunked_scan_finite_and_equal_to_the_token_loop(layout):
    # dt a down to -60 a token: a chunk's cumulative decay reaches thousands, whose exp(-Λ) would overflow
    inputs = scan_inputs(2 * DUAL_CHUNK, *layout, decay=60.0)
    expected_out, expected_state = steps(*inputs)
    out, state = long_pass(*inputs)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [MAMBA2, MAMBA1])
def test_the_chunked_scan_leaves_the_state_it_was_given(layout):
    a, d, state, *per_token = scan_inputs(DUAL_CHUNK + 3, *layout)
    before = state.clone()
    long_pass(a, d, state, *per_token)
    assert torch.equal(state, before)


@pytest.mark.parametrize("shape", [ScanShape(4, conv_channels=4096 + 256, heads=64, head_dim=64,
                                             state_size=128, groups=1),
                                   ScanShape(4, conv_channels=1536, heads=1536, head_dim=1, state_size=16,
                                             groups=1)])
def test_a_passs_estimate_covers_the_chunked_scans_largest_arrays(shape):
    tokens = 512
    inputs = scan_inputs(tokens, shape.heads, shape.head_dim, shape.state_size, shape.groups,
                         shape.head_dim == 1)
    held = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in long_pass(*inputs))
    if shape.head_dim > 1:  # the causal mixes: two [T, H, L] arrays
        held += 2 * 4 * tokens * shape.heads * DUAL_CHUNK
    else:  # the cumulative log-decays and the writes: [T, H, N] each
        held += 2 * 4 * tokens * shape.heads * shape.state_size
    assert shape.pass_bytes(tokens) >= held
