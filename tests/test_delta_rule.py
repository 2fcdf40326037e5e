"""Gated DeltaNet's computations (runtime/compute/delta_rule.py): the C kernels of the delta rule and of the
steps around it (cpu_kernels.ops) against their torch formulations (the *_in_torch forms,
cpu_kernels.reference), and the chunked form against the token loop. Each kernel matches torch,
gives a token the same bits alone or in a pass, and refuses shapes that disagree."""

import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tierflow.cpu_kernels.ops import conv_silu, delta_gates, delta_split, delta_steps, gated_rms_norm
from tierflow.cpu_kernels.torch_ops import gated_rms_norm_reference
from tierflow.runtime.compute.delta_rule import (
    CHUNK,
    StateBuffers,
    causal_conv_in_torch,
    chunked,
    gates_in_torch,
    split_heads_in_torch,
    step_in_torch,
    stepwise,
)

TAPS, CHANNELS = 4, 3 * 40 + 7  # a tail of 7 channels after whole vectors


def delta_inputs(tokens: int = 3, heads: int = 4, dk: int = 32, dv: int = 48) -> tuple[torch.Tensor, ...]:
    """A state and the tokens' L2-normed q, k [T, H, Dk], their v, decays g <= 0 and strengths beta."""
    generator = torch.Generator().manual_seed(3)
    q, k = (F.normalize(torch.randn(tokens, heads, dk, generator=generator), dim=-1) for _ in range(2))
    state = torch.randn(heads, dk, dv, generator=generator)
    v = torch.randn(tokens, heads, dv, generator=generator)
    g, beta = -torch.rand(tokens, heads, generator=generator), torch.rand(tokens, heads, generator=generator)
    return state, q, k, v, g, beta


def test_delta_steps_match_the_torch_formulation_token_by_token():
    state, *per_token = delta_inputs()
    out, after = delta_steps(state.numpy(), *(x.numpy() for x in per_token))
    expected = []
    for t in range(3):
        row, state = step_in_torch(state, *(x[t] for x in per_token))
        expected.append(row)
    torch.testing.assert_close(torch.from_numpy(out), torch.stack(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(after), state, rtol=1e-5, atol=1e-6)


def test_delta_steps_give_each_token_the_bits_of_a_pass_of_its_own():
    state, *per_token = (x.numpy() for x in delta_inputs())
    out, after = delta_steps(state, *per_token)
    for t in range(3):
        row, state = delta_steps(state, *(x[t:t + 1] for x in per_token))
        assert np.array_equal(row[0], out[t])
    assert np.array_equal(state, after)


def test_delta_steps_leave_the_state_they_were_given():
    inputs = [x.numpy() for x in delta_inputs()]
    before = inputs[0].copy()
    delta_steps(*inputs)
    assert np.array_equal(inputs[0], before)


def test_delta_steps_through_no_tokens_hand_back_the_state_they_were_given():
    state, *per_token = (x.numpy() for x in delta_inputs())
    out, after = delta_steps(state, *(x[:0] for x in per_token))
    assert out.shape == (0, 4, 48)
    assert np.array_equal(after, state)


def test_delta_steps_refuse_inputs_whose_heads_disagree_with_the_state():
    state, *per_token = (x.numpy() for x in delta_inputs())
    with pytest.raises(ValueError, match="disagree"):
        delta_steps(state[:3], *per_token)


def test_delta_steps_refuse_a_value_size_that_is_not_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        delta_steps(*(x.numpy() for x in delta_inputs(dv=40)))


def test_the_chunked_form_matches_the_token_loop_across_chunks_and_a_partial_one():
    state, *per_token = delta_inputs(tokens=2 * CHUNK + 5)
    out, after = chunked(state, *per_token)
    expected, expected_after = delta_steps(state.numpy(), *(x.numpy() for x in per_token))
    torch.testing.assert_close(out, torch.from_numpy(expected), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(after, torch.from_numpy(expected_after), rtol=1e-4, atol=1e-5)


def random(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def conv_inputs(tokens: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """history [K-1, C], x [T, C] and weight [C, K]."""
    return random(TAPS - 1, CHANNELS), random(tokens, CHANNELS, seed=1), random(CHANNELS, TAPS, seed=2)


def test_conv_silu_matches_torch():
    history, x, weight = conv_inputs()
    out = conv_silu(history.numpy(), x.numpy(), weight.numpy())
    torch.testing.assert_close(torch.from_numpy(out), causal_conv_in_torch(history, x, weight))


def test_conv_silu_with_a_bias_matches_torch():
    history, x, weight = conv_inputs()
    bias = random(CHANNELS, seed=3)
    out = conv_silu(history.numpy(), x.numpy(), weight.numpy(), bias.numpy())
    torch.testing.assert_close(torch.from_numpy(out), causal_conv_in_torch(history, x, weight, bias))


def test_conv_silu_refuses_a_bias_of_another_width():
    history, x, weight = (t.numpy() for t in conv_inputs())
    with pytest.raises(ValueError, match=r"bias \[C\]"):
        conv_silu(history, x, weight, np.zeros(CHANNELS + 1, np.float32))


def test_conv_silu_gives_a_token_the_same_bits_alone_as_in_a_pass():
    history, x, weight = (t.numpy() for t in conv_inputs())
    batch = conv_silu(history, x, weight)
    window = np.concatenate([history, x])
    for t in range(5):
        assert np.array_equal(conv_silu(window[t:t + TAPS - 1], x[t:t + 1], weight)[0], batch[t])


def test_conv_silu_refuses_a_history_that_is_not_its_taps_less_one():
    with pytest.raises(ValueError, match=r"history \[K-1, C\]"):
        conv_silu(*(np.zeros(shape, np.float32) for shape in ((TAPS, 32), (1, 32), (32, TAPS))))


@pytest.mark.parametrize("interleaved", [True, False])
def test_delta_split_matches_torch(interleaved):
    key_heads, value_heads, dk = 2, 6, 24
    conv_out = random(3, (2 * key_heads + value_heads) * dk, scale=3.0)
    q, k = delta_split(conv_out.numpy(), key_heads, value_heads, interleaved, 1e-6)
    expected = split_heads_in_torch(conv_out, key_heads, value_heads, interleaved, 1e-6)
    for ours, theirs in zip((q, k), expected):
        torch.testing.assert_close(torch.from_numpy(ours), theirs)


def test_delta_split_shares_a_key_head_as_the_layout_says():
    key_heads, value_heads, dk = 2, 4, 16
    conv_out = random(1, (2 * key_heads + value_heads) * dk).numpy()
    interleaved, _ = delta_split(conv_out, key_heads, value_heads, True, 1e-6)
    tiled, _ = delta_split(conv_out, key_heads, value_heads, False, 1e-6)
    assert np.array_equal(interleaved[0, 1], interleaved[0, 0])  # heads 0, 1 read key head 0
    assert np.array_equal(tiled[0, 2], tiled[0, 0])  # heads 0, 2 read key head 0
    assert not np.array_equal(tiled[0, 1], tiled[0, 0])


def test_delta_split_gives_a_token_the_same_bits_alone_as_in_a_pass():
    conv_out = random(4, 8 * 32).numpy()
    batch = delta_split(conv_out, 2, 4, False, 1e-6)
    for t in range(4):
        alone = delta_split(conv_out[t:t + 1], 2, 4, False, 1e-6)
        assert all(np.array_equal(a[0], b[t]) for a, b in zip(alone, batch))


def test_delta_split_refuses_a_width_the_heads_do_not_explain():
    with pytest.raises(ValueError, match="delta_split"):
        delta_split(random(1, 8 * 32 + 1).numpy(), 2, 4, False, 1e-6)


def test_delta_gates_match_torch_on_both_sides_of_softplus_threshold():
    alpha, beta_in = random(3, 8, scale=8.0), random(3, 8, seed=1, scale=8.0)
    dt, a = random(8, seed=2, scale=8.0), -random(8, seed=3).abs()
    alpha[0, :2] = torch.tensor([30.0, -30.0])  # softplus(x) = x above 20
    g, beta = delta_gates(*(t.numpy() for t in (alpha, beta_in, dt, a)))
    expected_g, expected_beta = gates_in_torch(alpha, beta_in, dt, a)
    torch.testing.assert_close(torch.from_numpy(g), expected_g)
    torch.testing.assert_close(torch.from_numpy(beta), expected_beta)


def test_delta_gates_refuse_per_head_vectors_of_another_length():
    alpha = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"dt, a \[H\]"):
        delta_gates(alpha, alpha, np.zeros(7, np.float32), np.zeros(8, np.float32))


def test_gated_rms_norm_matches_torch():
    x, weight, gate = random(6, 40), random(40, seed=1), random(6, 40, seed=2, scale=4.0)
    gate[0, :3] = torch.tensor([-1e30, -200.0, 1e30])  # silu: -0, -0 and the gate itself
    out = gated_rms_norm(x.numpy(), weight.numpy(), gate.numpy(), 1e-6)
    torch.testing.assert_close(torch.from_numpy(out), gated_rms_norm_reference(x, weight, gate, 1e-6))


def test_gated_rms_norm_refuses_a_gate_of_another_shape():
    x = np.ones((2, 16), np.float32)
    with pytest.raises(ValueError, match="gated_rms_norm"):
        gated_rms_norm(x, np.ones(16, np.float32), np.ones((2, 8), np.float32), 1e-6)


def test_a_state_array_is_taken_again_once_no_tensor_views_it():
    buffers = StateBuffers(limit=2)
    array = buffers.take((2, 16, 16))
    taken_before, tensor = weakref.ref(array), torch.from_numpy(array)
    del array, tensor
    assert buffers.take((2, 16, 16)) is taken_before()


def test_an_array_a_view_still_reads_is_never_handed_out():
    buffers = StateBuffers(limit=2)
    view = torch.from_numpy(buffers.take((2, 16, 16)))[1]  # the tensor it came from is gone
    assert buffers.take((2, 16, 16)).ctypes.data != view.data_ptr() - 16 * 16 * 4


def test_state_buffers_keep_at_most_their_limit():
    buffers = StateBuffers(limit=1)
    taken = [buffers.take((4, 16)) for _ in range(3)]  # all held at once: three arrays
    alive = [weakref.ref(array) for array in taken]
    del taken
    assert sum(ref() is not None for ref in alive) == 1


def test_stepwise_writes_the_next_state_into_a_recycled_array_with_the_same_result():
    state, *per_token = delta_inputs()
    buffers = StateBuffers(limit=2)
    out, after = stepwise(state, *per_token)
    out_recycled, _ = stepwise(state, *per_token, buffers=buffers)
    out_recycled, after_recycled = stepwise(state, *per_token, buffers=buffers)  # into the first's array
    assert torch.equal(out_recycled, out) and torch.equal(after_recycled, after)
