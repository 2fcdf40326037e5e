"""A sequence's recurrent state in its linear-attention layers, and how the cache goes back in it.

A KV cache goes back by forgetting rows; a recurrent state (runtime/delta_rule.py) cannot be
truncated, so this keeps what going back needs:
- `base`, the state at some length, and a record of every token fed since (its convolution input
  and output, decay and write strength: what the recurrence reads, no weights needed). The state
  after any of those tokens is the base's replayed along the token's ancestors, which is how
  rejected draft tokens are dropped (`truncate`) and a token tree's accepted path is kept
  (`keep_path`);
- `tip`, the state after the last token fed, so that a pass continuing from it replays nothing;
- up to CHECKPOINTS earlier states (at the start of each long prefill pass, and where the
  generator asks: before a prompt's last token, which a chat's next turn or a regeneration
  recomputes), to go back to.
A pass of at most STEPWISE_TOKENS tokens (decoding, draft verification, a token tree) runs token by
token and is recorded; a longer one (a prefill chunk) runs chunked but for its last token, which
is recorded, so the cache can go back into it to its start and to its last token. Tree tokens
each start from their parent's state, so a row of a
tree is bit for bit what decoding its path one token at a time gives.

States are torch tensors replaced, never written in place, so keeping one is keeping a reference.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tierflow.errors import InvalidArgumentError
from tierflow.runtime import delta_rule
from tierflow.runtime.config import ModelConfig, RecurrentShape

STEPWISE_TOKENS = 64  # a pass of at most this many tokens runs token by token and is recorded
CHECKPOINTS = 2  # states kept at earlier lengths besides the base

# conv outputs [T, C] -> (q, k [T, H, Dk], v [T, H, Dv]): the layer's split, norms and head sharing
Split = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def recurrent_state_bytes(shape: RecurrentShape) -> int:
    """What one sequence's state takes in one layer at most: the tip, the base, the checkpoints and
    a record of STEPWISE_TOKENS tokens."""
    record = 4 * (2 * shape.conv_channels + 2 * shape.value_heads)
    return (2 + CHECKPOINTS) * shape.state_bytes + STEPWISE_TOKENS * record


@dataclass(frozen=True)
class State:
    """The recurrence's state after some token: the convolution's last K-1 inputs [K-1, C] and the
    matrices [H, Dk, Dv]."""

    history: torch.Tensor
    matrices: torch.Tensor


@dataclass(frozen=True)
class Record:
    """One token's inputs to the recurrence: conv input and output [C], decay and strength [H]."""

    conv_in: torch.Tensor
    conv_out: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


@dataclass
class LayerStates:
    """One layer's states of one sequence (see the module's docstring); `split` is the layer's, kept
    from its last pass for replays."""

    base: State
    tip: State
    records: list[Record] = field(default_factory=list)
    checkpoints: dict[int, State] = field(default_factory=dict)
    split: Split | None = None


class RecurrentStates:
    """The recurrent layers' states of one sequence (one per KV cache), and the slots they are at.

    Slot s holds the token at cache slot s; `parents[i]` is the slot before record i's token (its
    predecessor in a chain, its parent in a tree), base_length - 1 meaning the base."""

    def __init__(self, config: ModelConfig, zeros: Callable[[int, tuple[int, ...]], torch.Tensor]):
        shape = config.recurrent
        self.layers: dict[int, LayerStates] = {}
        for layer in range(config.num_layers):
            if config.is_recurrent(layer):
                empty = State(zeros(layer, (shape.conv_kernel - 1, shape.conv_channels)),
                              zeros(layer, (shape.value_heads, shape.key_dim, shape.value_dim)))
                self.layers[layer] = LayerStates(empty, empty)
        self._empty = {layer: states.base for layer, states in self.layers.items()}  # the state of no tokens
        self.base_length = 0
        self.parents: list[int] = []  # per record
        self.tip_slot = -1  # the slot whose state `tip` is
        self._pass: _Pass | None = None

    # -- a pass --------------------------------------------------------------------------------

    def begin_pass(self, start: int, count: int, parents: np.ndarray | None, tree_start: int | None) -> None:
        """Told before a pass feeds `count` tokens at slots start.. (a tree's with parents from
        tree_start on, as Decoder.forward takes them). A pass that fails is dropped by `truncate`."""
        self._pass = None
        if parents is None:
            preds = list(range(start - 1, start + count - 1))
        else:
            first = start - tree_start
            preds = [tree_start - 1 if p < 0 else tree_start + int(p) for p in parents[first:first + count]]
        if preds[0] == self.tip_slot == start - 1 and (parents is None or tree_start == start):
            self._rebase(start)  # nothing before the pass is branched from again
        long = count > STEPWISE_TOKENS
        if long and (parents is not None or preds[0] != self.tip_slot):
            raise InvalidArgumentError(f"a pass of {count} tokens must continue the recurrent state it "
                                       f"follows: only {STEPWISE_TOKENS} tokens can branch from an earlier "
                                       f"one")
        if long:
            for states in self.layers.values():
                self._keep_checkpoint(states, start, states.tip)
        self._pass = _Pass(start, preds, long)

    def layer(self, layer: int) -> "RecurrentPass":
        """What the layer computes the current pass with."""
        return RecurrentPass(self, layer, self.layers[layer], self._pass)

    def end_pass(self) -> None:
        """The pass finished: each layer's last token's state is its tip, and its tokens are recorded
        (of a long pass the last one, after the state before it, the new base)."""
        run, self._pass = self._pass, None
        end = run.start + len(run.preds)
        recorded_from = end - 1 if run.long else run.start
        for layer, (tip, records, base) in run.results.items():
            states = self.layers[layer]
            states.tip = tip
            if base is not None:
                states.base, states.records = base, []
            del states.records[recorded_from - self.base_length if base is None else 0:]
            states.records.extend(records)
        if run.long:
            self.base_length, self.parents = end - 1, []
        self.parents[recorded_from - self.base_length:] = run.preds[recorded_from - run.start:]
        self.tip_slot = end - 1

    # -- going back ----------------------------------------------------------------------------

    def reachable(self, length: int) -> int:
        """The longest length <= `length` whose state can be had: 0, a checkpoint's, or one the
        records lead to along the chain from the base."""
        marks = [n for n in self._checkpoint_lengths() if n <= length] + [0]
        if self.base_length <= length:
            marks.append(min(length, self.base_length + self._chain_records()))
        return max(marks)

    def truncate(self, length: int) -> None:
        """Makes the state that after `length` tokens (one `reachable` gives)."""
        self._pass = None
        if self.reachable(length) != length:
            raise InvalidArgumentError(f"the recurrent state cannot go back to {length} tokens: it holds "
                                       f"checkpoints at {sorted(self._checkpoint_lengths())} and the tokens "
                                       f"from {self.base_length} on")
        if length == 0:
            for layer, states in self.layers.items():
                states.base = states.tip = self._empty[layer]
                states.records, states.checkpoints = [], {}
            self.base_length, self.parents, self.tip_slot = 0, [], -1
            return
        if length < self.base_length:
            for states in self.layers.values():
                states.base = states.tip = states.checkpoints[length]
                states.records = []
                states.checkpoints = {n: s for n, s in states.checkpoints.items() if n < length}
            self.base_length, self.parents, self.tip_slot = length, [], length - 1
            return
        kept = length - self.base_length
        for states in self.layers.values():
            states.tip = self._replay(states, length - 1)
            del states.records[kept:]
        del self.parents[kept:]
        self.tip_slot = length - 1

    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Of the tokens fed from slot `start` on, keeps those at the offsets (a root-to-node path)
        as slots start, start + 1, ...: their records, as a chain, and the last one's state as the tip."""
        first = start - self.base_length
        if first < 0:
            raise InvalidArgumentError(f"a token tree from slot {start}: the recurrent state holds the "
                                       f"tokens from {self.base_length} on only")
        for states in self.layers.values():
            states.tip = self._replay(states, start + offsets[-1] if offsets else start - 1)
            states.records[first:] = [states.records[first + i] for i in offsets]
        self.parents[first:] = list(range(start - 1, start - 1 + len(offsets)))
        self.tip_slot = start + len(offsets) - 1

    def checkpoint(self, length: int) -> None:
        """Keeps the state after `length` tokens (one the cache can reach) for a later turn."""
        if length in self._checkpoint_lengths() or length == 0 or self.reachable(length) != length:
            return
        for states in self.layers.values():
            self._keep_checkpoint(states, length, self._replay(states, length - 1))

    # -- internals -----------------------------------------------------------------------------

    def _rebase(self, length: int) -> None:
        """The tip, at `length` tokens, becomes the base; the records before it are dropped."""
        for states in self.layers.values():
            states.base, states.records = states.tip, []
        self.base_length, self.parents, self.tip_slot = length, [], length - 1

    def _keep_checkpoint(self, states: LayerStates, length: int, state: State) -> None:
        states.checkpoints[length] = state
        while len(states.checkpoints) > CHECKPOINTS:
            del states.checkpoints[min(states.checkpoints)]

    def _checkpoint_lengths(self) -> list[int]:
        first = next(iter(self.layers.values()), None)
        return [] if first is None else list(first.checkpoints)

    def _chain_records(self) -> int:
        """How many records from the base on form a chain (each token's predecessor the slot before)."""
        count = 0
        for i, parent in enumerate(self.parents):
            if parent != self.base_length + i - 1:
                break
            count += 1
        return count

    def _replay(self, states: LayerStates, slot: int) -> State:
        """The state after the token at `slot`: the tip's if it is, else the base's replayed along
        the slot's ancestors."""
        if slot == self.tip_slot:
            return states.tip
        path = []
        while slot >= self.base_length:
            path.append(slot)
            slot = self.parents[slot - self.base_length]
        state = states.base
        for node in reversed(path):
            state = _advance(state, states.records[node - self.base_length], states.split)
        return state


@dataclass
class _Pass:
    start: int
    preds: list[int]  # each token's predecessor slot
    long: bool  # run chunked and not recorded
    # per layer till the pass ends: its tip, its records and (a long pass) the state before its last token
    results: dict[int, tuple[State, list[Record], State | None]] = field(default_factory=dict)


class RecurrentPass:
    """One layer's share of one pass of one sequence: runs the recurrence over the pass's tokens."""

    def __init__(self, owner: RecurrentStates, layer: int, states: LayerStates, run: _Pass):
        self.owner, self.layer, self.states, self.run = owner, layer, states, run

    def __call__(self, conv_in: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 split: Split) -> torch.Tensor:
        """The recurrence's outputs [T, H, Dv] for the pass's tokens: conv_in [T, C] (before the
        convolution), conv_weight [C, K], g and beta [T, H]."""
        states, run = self.states, self.run
        states.split = split
        if not run.long and any(p != i + run.start - 1 for i, p in enumerate(run.preds)):
            return self._tree(conv_in, conv_weight, g, beta, split)
        start = self.owner._replay(states, run.preds[0])
        conv_out = delta_rule.causal_conv(start.history, conv_in, conv_weight)
        q, k, v = split(conv_out)
        base, stepped = None, 0  # a long pass: all but its last token chunked, that one recorded
        matrices = start.matrices
        outs = []
        if run.long:
            stepped = len(run.preds) - 1
            out, matrices = delta_rule.chunked(matrices, q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1])
            outs.append(out)
            base = State(torch.cat([start.history, conv_in[:-1]])[-start.history.shape[0]:], matrices)
        out, matrices = delta_rule.stepwise(matrices, q[stepped:], k[stepped:], v[stepped:], g[stepped:],
                                            beta[stepped:])
        outs.append(out)
        history = torch.cat([start.history, conv_in])[-start.history.shape[0]:]
        records = _records(conv_in[stepped:], conv_out[stepped:], g[stepped:], beta[stepped:])
        run.results[self.layer] = (State(history, matrices), records, base)
        return torch.cat(outs)

    def _tree(self, conv_in, conv_weight, g, beta, split) -> torch.Tensor:
        """Each token from its parent's state, one at a time."""
        states, run = self.states, self.run
        computed: dict[int, State] = {}
        outs, conv_outs = [], []
        for i, pred in enumerate(run.preds):
            before = computed[pred] if pred in computed else self.owner._replay(states, pred)
            conv_out = delta_rule.causal_conv(before.history, conv_in[i:i + 1], conv_weight)
            q, k, v = split(conv_out)
            out, matrices = delta_rule.step(before.matrices, q[0], k[0], v[0], g[i], beta[i])
            computed[run.start + i] = State(torch.cat([before.history[1:], conv_in[i:i + 1]]), matrices)
            outs.append(out)
            conv_outs.append(conv_out)
        tip = computed[run.start + len(run.preds) - 1]
        run.results[self.layer] = (tip, _records(conv_in, torch.cat(conv_outs), g, beta), None)
        return torch.stack(outs)


def _records(conv_in, conv_out, g, beta) -> list[Record]:
    return [Record(*row) for row in zip(conv_in, conv_out, g, beta)]


def _advance(state: State, record: Record, split: Split) -> State:
    """The state after one more token, from its record."""
    q, k, v = split(record.conv_out[None])
    _, matrices = delta_rule.step(state.matrices, q[0], k[0], v[0], record.g, record.beta)
    return State(torch.cat([state.history[1:], record.conv_in[None]]), matrices)
