"""Mamba's selective scan (runtime/compute/selective_scan.py): the C kernels' token loop (`steps` on
the CPU) and the chunked forms (`chunked`: Mamba-2's state-space-duality blocks, Mamba-1's recursive
doubling, which other devices' prefills run) against the torch token loop (`steps_in_torch`), from a
nonzero state, over passes shorter than a chunk, of whole chunks and between them; every token's bits
the same in a pass of any length; the budget's estimate of what a pass holds (ScanShape.pass_bytes);
and the output gate after the scan (`gate`: y * silu(z), Mamba-2's grouped RMSNorm)."""

import numpy as np
import pytest
import torch

from tierflow.cpu_kernels import ops
from tierflow.runtime.compute.delta_rule import StateBuffers
from tierflow.runtime.compute.selective_scan import (
    DUAL_CHUNK,
    SCAN_CHUNK,
    chunked,
    gate,
    gate_in_torch,
    long_pass,
    steps,
    steps_in_torch,
)
from tierflow.runtime.memory.state_shapes import ScanShape

# (heads, head size, state size, groups, decay per state element): Mamba-2's and Mamba-1's layouts
MAMBA2, MAMBA1 = (8, 16, 32, 2, False), (24, 1, 16, 1, True)
# the kernels' awkward cases: a head size no multiple of their 8-row blocks, heads no multiple of 8
# channels, a state of 128 (Granite's, their unrolled case) and one of 48 (their general case)
ODD_SHAPES = [(6, 12, 48, 3, False), (20, 1, 16, 1, True), (2, 64, 128, 1, False), (5, 1, 32, 1, True)]


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


def assert_gives_the_torch_loops_result(form, inputs: tuple[torch.Tensor, ...], tolerance: float) -> None:
    """form(*inputs)'s outputs and state are the torch token loop's within `tolerance`."""
    expected_out, expected_state = steps_in_torch(*inputs)
    out, state = form(*inputs)
    torch.testing.assert_close(out, expected_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(state, expected_state, rtol=tolerance, atol=tolerance)


def lengths(chunk: int) -> list[int]:
    return [1, 7, chunk - 1, chunk, chunk + 1, 3 * chunk + 5]


@pytest.mark.parametrize("layout, tokens", [(MAMBA2, t) for t in lengths(DUAL_CHUNK)]
                         + [(MAMBA1, t) for t in lengths(SCAN_CHUNK)])
def test_the_chunked_scan_gives_the_token_loops_outputs_and_state_up_to_float_rounding(layout, tokens):
    assert_gives_the_torch_loops_result(chunked, scan_inputs(tokens, *layout), 1e-4)


@pytest.mark.parametrize("layout", [MAMBA2, MAMBA1])
def test_strong_decays_leave_the_chunked_scan_finite_and_equal_to_the_token_loop(layout):
    # dt a down to -60 a token: a chunk's cumulative decay reaches thousands, whose exp(-Λ) would overflow
    inputs = scan_inputs(2 * DUAL_CHUNK, *layout, decay=60.0)
    out, state = chunked(*inputs)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    assert_gives_the_torch_loops_result(chunked, inputs, 1e-4)


@pytest.mark.parametrize("layout", [MAMBA2, MAMBA1])
@pytest.mark.parametrize("scan", [chunked, steps], ids=["chunked", "kernels"])
def test_a_scan_leaves_the_state_it_was_given(layout, scan):
    a, d, state, *per_token = scan_inputs(DUAL_CHUNK + 3, *layout)
    before = state.clone()
    scan(a, d, state, *per_token)
    assert torch.equal(state, before)


@pytest.mark.parametrize("layout", [MAMBA2, MAMBA1, *ODD_SHAPES])
@pytest.mark.parametrize("tokens", [1, 9])
def test_the_kernels_scan_gives_the_torch_loops_outputs_and_state_up_to_float_rounding(layout, tokens):
    assert_gives_the_torch_loops_result(steps, scan_inputs(tokens, *layout), 1e-5)


@pytest.mark.parametrize("layout", [MAMBA2, MAMBA1, *ODD_SHAPES])
def test_the_kernels_give_each_token_the_bits_a_pass_of_it_alone_gives(layout):
    a, d, state, x, b, c, dt = scan_inputs(11, *layout)
    whole, last = steps(a, d, state, x, b, c, dt)
    rows = []
    for t in range(11):
        row, state = steps(a, d, state, x[t:t + 1], b[t:t + 1], c[t:t + 1], dt[t:t + 1])
        rows.append(row)
    assert torch.equal(torch.cat(rows), whole) and torch.equal(state, last)


def test_the_kernels_long_pass_is_their_token_loop():
    inputs = scan_inputs(DUAL_CHUNK + 5, *MAMBA2)
    assert all(torch.equal(x, y) for x, y in zip(long_pass(*inputs), steps(*inputs)))


def test_the_kernels_write_the_new_state_into_a_recycled_array():
    buffers = StateBuffers(limit=1)
    inputs = scan_inputs(3, *MAMBA2)
    _, first = steps(*inputs, buffers=buffers)
    first_address = first.data_ptr()
    del first
    _, second = steps(*inputs, buffers=buffers)
    assert second.data_ptr() == first_address


def test_the_kernels_refuse_arrays_whose_shapes_disagree():
    a, d, state, x, b, c, dt = (t.numpy() for t in scan_inputs(3, *MAMBA2))
    with pytest.raises(ValueError, match="scan_steps"):
        ops.scan_steps(state, x, dt, a.reshape(len(a), -1), b[:, :1].copy(), c, d)  # B's groups not C's
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.scan_steps(state[..., :24].copy(), x, dt, a.reshape(len(a), -1), b[..., :24].copy(),
                       c[..., :24].copy(), d)


def test_a_state_size_the_kernels_do_not_take_runs_in_torch():
    inputs = scan_inputs(4, 4, 8, 20, 1, False)  # N = 20: no multiple of 16
    assert all(torch.equal(x, y) for x, y in zip(steps(*inputs), steps_in_torch(*inputs)))


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


@pytest.mark.parametrize("groups", [None, 1, 4])
def test_the_kernels_gate_gives_the_torch_gates_rows(groups):
    generator = torch.Generator().manual_seed(5)
    y, z = (torch.randn(7, 96, generator=generator) * 3 for _ in range(2))
    weight = None if groups is None else torch.randn(96, generator=generator)
    expected = gate_in_torch(y, z, weight, groups or 1, 1e-6)
    torch.testing.assert_close(gate(y, z, weight, groups or 1, 1e-6), expected, rtol=1e-5, atol=1e-5)


def test_the_kernels_gate_gives_a_row_the_same_bits_alone_as_among_others():
    generator = torch.Generator().manual_seed(6)
    y, z, weight = (torch.randn(*shape, generator=generator) for shape in ((5, 64), (5, 64), (64,)))
    together = gate(y, z, weight, 2, 1e-6)
    assert all(torch.equal(gate(y[i:i + 1], z[i:i + 1], weight, 2, 1e-6)[0], together[i]) for i in range(5))


def test_the_kernels_gate_refuses_groups_that_do_not_divide_the_channels():
    y = np.zeros((2, 96), np.float32)
    with pytest.raises(ValueError, match="gate_group_norm"):
        ops.gate_group_norm(y, y, np.ones(96, np.float32), 5, 1e-6)
