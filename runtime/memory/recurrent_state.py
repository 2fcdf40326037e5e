"""A sequence's recurrent state in its recurrent layers (Gated DeltaNet's, Mamba's), and how the
cache goes back in it.

A KV cache goes back by forgetting rows; a recurrent state (runtime/compute/delta_rule.py,
selective_scan.py) cannot be truncated, so this keeps what going back needs:
- `base`, the state at some length, and a record of every token fed since (its convolution input
  and what the update read: no weights needed). The state
  after any of those tokens is the base's replayed along the token's ancestors, which is how
  rejected draft tokens are dropped (`truncate`) and a token tree's accepted path is kept
  (`keep_path`);
- `tip`, the state after the last token fed, so that a pass continuing from it replays nothing;
- up to CHECKPOINTS earlier states (at the start of each long prefill pass, and where the
  generator asks: before a prompt's last token, which a chat's next turn or a regeneration
  recomputes), to go back to.
A pass of at most STEPWISE_TOKENS tokens (decoding, draft verification, a token tree) runs token by
token and is recorded; a longer one (a prefill chunk) runs as its layer's long pass but for its last
token, which is recorded, so the cache can go back into it to its start and to its last token. Tree
tokens each start from their parent's state, so a row of a tree is bit for bit what decoding its path
one token at a time gives. What the recurrence is, the layer says for each pass (`Recurrence`); the
state's size, its shape (state_shapes.py).

States are torch tensors replaced, never written in place, so keeping one is keeping a reference.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.compute import delta_rule
from tierflow.runtime.memory.state_shapes import StateShape, state_bytes

STEPWISE_TOKENS = 64  # the most tokens a pass can run token by token and record
CHUNKED_FROM = 17  # a prefill pass of at least this many tokens runs chunked (faster from about here)
CHECKPOINTS = 2  # states kept at earlier lengths besides the base
# the most states one layer of a sequence holds: the tip, the base and the checkpoints, and while a
# long pass runs its new base and tip too (the old tip being one checkpoint)
STATES_HELD = 3 + CHECKPOINTS

# (matrices, each input [T, ...], buffers) -> (outputs [T, ...], the matrices after the last token)
Steps = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Recurrence:
    """A layer's recurrence as its state runs it, made by the layer for each pass. The tokens'
    convolution inputs [T, C] go through the causal convolution of conv_weight [C, K] (plus
    conv_bias [C] where given) and a silu; `inputs` turns its outputs into what each token's update
    reads (it may use the layer's weights: it runs within the pass only), which is recorded with the
    gates the layer computed before the convolution. `steps` runs the update token by token (each
    token's bits whatever the pass, as decoding gives them), `long_pass` a prefill chunk's (the same
    up to rounding), both from recorded tensors alone: replays run the last pass's `steps`."""

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    steps: Steps
    long_pass: Steps


def recurrent_state_bytes(shape: StateShape) -> int:
    """What one sequence's state takes in one layer at most: STATES_HELD states and a record of
    STEPWISE_TOKENS tokens."""
    return STATES_HELD * state_bytes(shape) + STEPWISE_TOKENS * shape.record_bytes


@dataclass(frozen=True)
class State:
    """The recurrence's state after some token: the convolution's last K-1 inputs [K-1, C] and the
    matrices [H, Dk, Dv]."""

    history: torch.Tensor
    matrices: torch.Tensor


@dataclass(frozen=True)
class Record:
    """One token's inputs to the recurrence: its convolution input [C] and what its update reads
    (the Recurrence's inputs and gates, each of the token's row)."""

    conv_in: torch.Tensor
    inputs: tuple[torch.Tensor, ...]


@dataclass
class LayerStates:
    """One layer's states of one sequence (see the module's docstring); `recurrence` is the layer's,
    kept from its last pass for replays."""

    base: State
    tip: State
    penultimate: State | None = None  # the state before the tip's token, where a chain pass left it
    records: list[Record] = field(default_factory=list)
    checkpoints: dict[int, State] = field(default_factory=dict)
    recurrence: Recurrence | None = None
    # the arrays new states are written into: kept, as many as the budget counts (recurrent_state_bytes)
    buffers: delta_rule.StateBuffers = field(default_factory=lambda: delta_rule.StateBuffers(STATES_HELD))


class RecurrentStates:
    """The recurrent layers' states of one sequence (one per KV cache), and the slots they are at.

    Slot s holds the token at cache slot s; `parents[i]` is the slot before record i's token (its
    predecessor in a chain, its parent in a tree), base_length - 1 meaning the base."""

    def __init__(self, shape: StateShape, layers: Iterable[int],
                 zeros: Callable[[int, tuple[int, ...]], torch.Tensor]):
        self.layers: dict[int, LayerStates] = {}
        for layer in layers:
            empty = State(zeros(layer, (shape.conv_kernel - 1, shape.conv_channels)),
                          zeros(layer, shape.matrix_shape))
            self.layers[layer] = LayerStates(empty, empty)
        self._empty = {layer: states.base for layer, states in self.layers.items()}  # the state of no tokens
        self.base_length = 0
        self.parents: list[int] = []  # per record
        self.tip_slot = -1  # the slot whose state `tip` is
        self.penultimate_slot = -2  # the slot whose state `penultimate` is (the tip's predecessor), if any
        self._pass: _Pass | None = None

    @property
    def num_bytes(self) -> int:
        """What the states hold now: each state kept once, however many roles it has, and the records."""
        seen, total = set(), 0
        for states in self.layers.values():
            for state in (states.base, states.tip, states.penultimate, *states.checkpoints.values()):
                if state is not None and id(state) not in seen:
                    seen.add(id(state))
                    total += state.history.nbytes + state.matrices.nbytes
            total += sum(x.nbytes for record in states.records for x in (record.conv_in, *record.inputs))
        return total

    # -- a pass --------------------------------------------------------------------------------

    def begin_pass(self, start: int, count: int, parents: np.ndarray | None, tree_start: int | None,
                   exact: bool) -> None:
        """Told before a pass feeds `count` tokens at slots start.. (a tree's with parents from
        tree_start on, as Decoder.forward takes them). An exact pass (verification) runs token by
        token, as decoding does; a prefill pass from CHUNKED_FROM tokens on runs chunked. A pass
        that fails is dropped by `truncate`."""
        self._pass = None
        if parents is None:
            preds = list(range(start - 1, start + count - 1))
        else:
            first = start - tree_start
            preds = [tree_start - 1 if p < 0 else tree_start + int(p) for p in parents[first:first + count]]
        if preds[0] == self.tip_slot == start - 1 and (parents is None or tree_start == start):
            self._rebase(start)  # nothing before the pass is branched from again
        long = count > STEPWISE_TOKENS or count >= CHUNKED_FROM and not exact
        if long and (parents is not None or preds[0] != self.tip_slot):
            raise InvalidArgumentError(f"a pass of {count} tokens must continue the recurrent state it "
                                       f"follows: only {STEPWISE_TOKENS} tokens can branch from an earlier "
                                       f"one")
        if long:
            for states in self.layers.values():
                self._keep_checkpoint(states, start, states.tip)
        self._pass = _Pass(start, preds, long)

    def layer_pass(self, layer: int) -> dict:
        """A recurrent layer's share of a pass (SequencePass.recurrent); nothing of another layer."""
        return {"recurrent": self.layer(layer)} if layer in self.layers else {}

    def layer(self, layer: int) -> "RecurrentPass":
        """What the layer computes the current pass with."""
        return RecurrentPass(self, layer, self.layers[layer], self._pass)

    def end_pass(self) -> None:
        """The pass finished: each layer's last token's state is its tip, and its tokens are recorded
        (of a chunked pass the last one, after the state before it, the new base); a chain's state
        before its last token is kept as `penultimate` (a prompt's checkpoint)."""
        run, self._pass = self._pass, None
        end = run.start + len(run.preds)
        recorded_from = end - 1 if run.long else run.start
        for layer, result in run.results.items():
            states = self.layers[layer]
            states.tip, states.penultimate = result.tip, result.penultimate
            if run.long:
                states.base, states.records = result.penultimate, []
            del states.records[recorded_from - self.base_length if not run.long else 0:]
            states.records.extend(result.records)
        if run.long:
            self.base_length, self.parents = end - 1, []
        self.parents[recorded_from - self.base_length:] = run.preds[recorded_from - run.start:]
        self.tip_slot = end - 1
        self.penultimate_slot = end - 2 if run.chain else -2

    # -- going back ----------------------------------------------------------------------------

    can_shift = False  # a state cannot drop tokens from its middle: the kept ones are prefilled again

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
            self.base_length, self.parents, self.tip_slot, self.penultimate_slot = 0, [], -1, -2
            return
        if length < self.base_length:
            for states in self.layers.values():
                states.base = states.tip = states.checkpoints[length]
                states.records = []
                states.checkpoints = {n: s for n, s in states.checkpoints.items() if n < length}
            self.base_length, self.parents, self.tip_slot, self.penultimate_slot = length, [], length - 1, -2
            return
        kept = length - self.base_length
        for states in self.layers.values():
            states.tip = self._replay(states, length - 1)
            del states.records[kept:]
        del self.parents[kept:]
        self.tip_slot, self.penultimate_slot = length - 1, -2

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
        self.tip_slot, self.penultimate_slot = start + len(offsets) - 1, -2

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
        """The state after the token at `slot`: the tip's or the penultimate's if it is, else the
        base's replayed along the slot's ancestors."""
        if slot == self.tip_slot:
            return states.tip
        if slot == self.penultimate_slot:
            return states.penultimate
        path = []
        while slot >= self.base_length:
            path.append(slot)
            slot = self.parents[slot - self.base_length]
        state = states.base
        for node in reversed(path):
            _, state = _advance(state, states.records[node - self.base_length], states)
        return state


@dataclass(frozen=True)
class _Result:
    """What one layer's pass leaves, kept till the pass ends."""

    tip: State
    records: list[Record]
    penultimate: State | None  # a chain's state before its last token


@dataclass
class _Pass:
    start: int
    preds: list[int]  # each token's predecessor slot
    long: bool  # run chunked (all but the last token) and not recorded
    results: dict[int, _Result] = field(default_factory=dict)  # per layer

    @property
    def chain(self) -> bool:
        """Whether each token follows the one before (not a tree)."""
        return all(p == i + self.start - 1 for i, p in enumerate(self.preds))


class RecurrentPass:
    """One layer's share of one pass of one sequence: runs the recurrence over the pass's tokens."""

    def __init__(self, owner: RecurrentStates, layer: int, states: LayerStates, run: _Pass):
        self.owner, self.layer, self.states, self.run = owner, layer, states, run

    def __call__(self, conv_in: torch.Tensor, gates: tuple[torch.Tensor, ...], recurrence: Recurrence
                 ) -> torch.Tensor:
        """The recurrence's outputs [T, ...] for the pass's tokens: conv_in [T, C] (before the
        convolution), gates each [T, ...] (what the layer computed of the tokens before it)."""
        states, run = self.states, self.run
        states.recurrence = recurrence
        if not run.chain:
            return self._tree(conv_in, gates, recurrence)
        start = self.owner._replay(states, run.preds[0])
        conv_out = delta_rule.causal_conv(start.history, conv_in, recurrence.conv_weight,
                                          recurrence.conv_bias)
        inputs = (*recurrence.inputs(conv_out), *gates)
        # all but the last token as a long pass (a prefill chunk) or one by one, then the last one
        taps, most = start.history.shape[0], len(conv_in) - 1
        penultimate, out = start, None
        if most:
            run_most = recurrence.long_pass if run.long else recurrence.steps
            out, matrices = run_most(start.matrices, *(x[:most] for x in inputs), states.buffers)
            penultimate = State(torch.cat([start.history, conv_in[:most]])[-taps:], matrices)
        last, matrices = recurrence.steps(penultimate.matrices, *(x[most:] for x in inputs), states.buffers)
        tip = State(torch.cat([start.history, conv_in])[-taps:], matrices)
        recorded = most if run.long else 0
        records = _records(conv_in[recorded:], [x[recorded:] for x in inputs])
        run.results[self.layer] = _Result(tip, records, penultimate)
        return last if out is None else torch.cat([out, last])

    def _tree(self, conv_in: torch.Tensor, gates: tuple[torch.Tensor, ...], recurrence: Recurrence
              ) -> torch.Tensor:
        """Each token from its parent's state, one at a time."""
        states, run = self.states, self.run
        computed: dict[int, State] = {}
        outs, records = [], []
        for i, pred in enumerate(run.preds):
            before = computed[pred] if pred in computed else self.owner._replay(states, pred)
            conv_out = delta_rule.causal_conv(before.history, conv_in[i:i + 1], recurrence.conv_weight,
                                              recurrence.conv_bias)
            inputs = (*recurrence.inputs(conv_out), *(g[i:i + 1] for g in gates))
            [record] = _records(conv_in[i:i + 1], inputs)
            out, computed[run.start + i] = _advance(before, record, states)
            outs.append(out)
            records.append(record)
        run.results[self.layer] = _Result(computed[run.start + len(run.preds) - 1], records, None)
        return torch.stack(outs)


def _records(conv_in: torch.Tensor, inputs: Iterable[torch.Tensor]) -> list[Record]:
    """Each token's record, copied out of the pass's activations (a row kept as a view would keep
    all of them)."""
    return [Record(row[0].clone(), tuple(x.clone() for x in row[1:])) for row in zip(conv_in, *inputs)]


def _advance(state: State, record: Record, states: LayerStates) -> tuple[torch.Tensor, State]:
    """One more token of the layer's from its record: its output and the state after it."""
    out, matrices = states.recurrence.steps(state.matrices, *(x[None] for x in record.inputs), states.buffers)
    return out[0], State(torch.cat([state.history[1:], record.conv_in[None]]), matrices)
