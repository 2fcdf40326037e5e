"""The shapes of the fixed-size states that recurrent layers keep per sequence (held by
recurrent_state.py, counted by kinds.py's RecurrentState): each says how large its state, a token's
record and a pass's activations are, so that one store, the budgets and the planner serve every
recurrence alike. Both keep the last conv_kernel - 1 inputs of a causal convolution over
conv_channels and a matrix per head:

    RecurrentShape  Gated DeltaNet's (runtime/compute/delta_rule.py): a key x value matrix per value head
    ScanShape       Mamba's selective scan (runtime/compute/selective_scan.py): head size x state size
"""

import math
from dataclasses import dataclass
from typing import Protocol

from tierflow.runtime.compute import delta_rule, selective_scan


class StateShape(Protocol):
    """What a recurrent layer's state is, per sequence."""

    conv_kernel: int

    @property
    def conv_channels(self) -> int: ...

    @property
    def matrix_shape(self) -> tuple[int, int, int]: ...  # [heads, rows, columns] of the state's matrices

    @property
    def record_bytes(self) -> int: ...  # one token's record: its convolution input and what the update reads

    def pass_bytes(self, tokens: int) -> int: ...  # the activations a pass of `tokens` tokens holds, at most


def state_bytes(shape: StateShape) -> int:
    """float32 bytes of one sequence's state in one layer: the convolution's and the matrices."""
    return 4 * (shape.conv_channels * (shape.conv_kernel - 1) + math.prod(shape.matrix_shape))


@dataclass(frozen=True)
class RecurrentShape:
    """A Gated DeltaNet layer's state: the convolution over the queries, keys and values side by
    side, and a key_dim x value_dim matrix per value head. Queries and keys have key_heads heads,
    each shared by value_heads / key_heads value heads."""

    conv_kernel: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def matrix_shape(self) -> tuple[int, int, int]:
        return self.value_heads, self.key_dim, self.value_dim

    @property
    def record_bytes(self) -> int:
        """The convolution's input and output, decay and write strength."""
        return 4 * (2 * self.conv_channels + 2 * self.value_heads)

    def pass_bytes(self, tokens: int) -> int:
        """An estimate: the convolution's inputs and outputs, the queries and keys shared out to every
        value head, and the chunked form's blocks: about ten copies of the values' width and a
        CHUNK-wide score row per token and value head, on both sides of the triangular solve."""
        width = self.value_heads * max(self.key_dim, self.value_dim)
        per_token = 2 * self.conv_channels + 12 * width + 4 * self.value_heads * delta_rule.CHUNK
        return 4 * tokens * per_token


@dataclass(frozen=True)
class ScanShape:
    """A Mamba layer's state: the convolution over conv_channels (Mamba-1: the inner channels;
    Mamba-2: those and B and C of every group) and a head_dim x state_size matrix per head (Mamba-1:
    every inner channel a head of one). B and C come in `groups`, each shared by heads / groups heads."""

    conv_kernel: int
    conv_channels: int
    heads: int
    head_dim: int
    state_size: int
    groups: int

    @property
    def matrix_shape(self) -> tuple[int, int, int]:
        return self.heads, self.head_dim, self.state_size

    @property
    def record_bytes(self) -> int:
        """The convolution's input, and x, the time step, B and C."""
        return 4 * (self.conv_channels + self.heads * (self.head_dim + 1) + 2 * self.groups * self.state_size)

    def pass_bytes(self, tokens: int) -> int:
        """An estimate: the convolution's inputs and outputs, x, its gate and the scan's outputs per
        token, a few states, and the larger of what the two forms of the scan hold: the token loop
        (selective_scan.steps: B and C of every head, the decays) and the chunked one (long_pass:
        Mamba-2's scaled x, its blocks' outputs and decayed writes, and two L-wide rows of causal
        mixes per token and head; Mamba-1's cumulative log-decays and writes per state element, and
        a chunk's states while doubling)."""
        inner, elements = self.heads * self.head_dim, self.heads * self.state_size
        if self.head_dim == 1:
            stepwise = 3 * elements
            chunked = tokens * 3 * elements + 4 * selective_scan.SCAN_CHUNK * elements
        else:
            stepwise = 2 * elements + self.heads
            padded = -(-tokens // selective_scan.DUAL_CHUNK) * selective_scan.DUAL_CHUNK
            chunked = padded * (6 * inner + 2 * self.heads * selective_scan.DUAL_CHUNK
                                + 2 * self.groups * self.state_size)
        per_token = 2 * self.conv_channels + 4 * inner
        return 4 * (tokens * per_token + max(tokens * stepwise, chunked) + 3 * elements * self.head_dim)
