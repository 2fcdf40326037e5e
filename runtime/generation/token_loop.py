"""The token loop: prefill the prompt, then decode one token at a time until a stop condition."""

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tierflow.errors import BudgetError
from tierflow.kv_types import MAX_PASS_TOKENS
from tierflow.runtime.decoder.decoder import Decoder, SequenceInput
from tierflow.runtime.generation.stats import GenerationStats, PrefillProgress
from tierflow.runtime.memory.hidden_trail import HiddenTrail
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.sampling.sampler import Sampler

PREFILL_CHUNK = MAX_PASS_TOKENS  # tokens per prefill pass: bounds activation memory and cancel latency


class TokenGenerator:
    """Runs the decoder over one KV cache, remembering which tokens the cache holds so that a
    prompt sharing a prefix with the previous one (a chat's history) skips that prefix.

    A prefix is reused only as far as the cache is exact (bit-identical to a fresh prefill of its
    tokens: the decoder is batch-invariant), so output never depends on what ran before; a
    context shift (`shift`) moves entries that were computed with the dropped tokens in view,
    which only a prefill that asks for it (`shifted=True`, a conversation that dropped its oldest
    turns) reuses. A sliding-window layer's ring goes back only as far as it still holds the
    window before the new end (KVCache.can_truncate_to): a prefix that diverges further back is
    prefilled again from the start. A recurrent state goes back only to the states it kept (the end
    of each prompt among them: KVCache.reachable), and is prefilled again from the nearest.
    """

    def __init__(self, decoder: Decoder, cache: KVCache):
        self.decoder = decoder
        self.cache = cache
        # runs a pass of this sequence: alone, or batched with other generators'
        # (runtime/generation/batching.py)
        self.run_pass: Callable[[SequenceInput], np.ndarray] = lambda item: decoder.forward_batch([item])[0]
        self.cached_tokens: list[int] = []  # the tokens whose keys/values are in the cache
        self.exact_length = 0  # of those, the leading ones a fresh prefill would write bit for bit
        self.trail: HiddenTrail | None = None  # the final-normed hidden states, kept for an MTP draft

    def release(self) -> None:
        """Lets go of the decoder (and through it the weights; run_pass holds it too) and the KV
        cache: a closed engine's generators hold no memory, however long the Engine object lives on."""
        self.decoder = self.cache = self.run_pass = None

    def prefill(self, token_ids: list[int], cancel: threading.Event, all_logits: bool = False,
                reuse_prefix: bool = True, progress: PrefillProgress | None = None,
                shifted: bool = False) -> tuple[np.ndarray | None, int]:
        """Feeds token_ids; returns (logits of the last token, or of all new tokens when
        all_logits; None if cancelled) and how many leading tokens were reused from the cache;
        progress, if given, is told how far it got chunk by chunk. With shifted, a prompt that is
        the cached tokens less one run after a kept prefix (cached[:a] + cached[b:c] + new
        tokens) shifts the cache rather than prefilling cached[b:c] again (llama.cpp's server
        calls it cache reuse), and entries an earlier shift moved are reused too."""
        reused = self._reuse(token_ids, shifted) if reuse_prefix else 0
        self._truncate(reused)
        chunks = []
        for start in range(reused, len(token_ids), PREFILL_CHUNK):
            if progress is not None:
                progress(start, len(token_ids))
            if cancel.is_set():
                return None, reused
            chunks.append(self._forward(token_ids[start:start + PREFILL_CHUNK], all_logits))
        if progress is not None:
            progress(len(token_ids), len(token_ids))
        self.cache.checkpoint()  # a chat's next turn starts from here
        return np.concatenate(chunks) if all_logits else chunks[-1][-1], reused

    def decode_step(self, token_id: int) -> np.ndarray:
        """Feeds one token; returns the logits [V] for the next."""
        return self._forward([token_id], all_logits=False)[-1]

    def verify(self, token_ids: list[int]) -> np.ndarray:
        """Feeds a token and guesses of the ones after it in one pass: logits [T, V], row i for
        the token after token_ids[i]. Each row is bit-identical to feeding the tokens one by one
        (the decoder is batch-invariant), so accepting a guess never changes the output."""
        return self._forward(token_ids, all_logits=True)

    def keep(self, length: int) -> None:
        """Forgets the cache past `length` tokens (guesses the target did not accept). Where a ring
        no longer holds the window before `length`, the tokens up to it are prefilled again."""
        if self.cache.can_truncate_to(length):
            self._truncate(length)
        else:
            self.prefill(self.cached_tokens[:length], threading.Event(), reuse_prefix=False)

    def verify_tree(self, token_ids: list[int], parents: list[int],
                    tree_start: int | None = None) -> np.ndarray:
        """Like verify, for tokens that extend a token tree begun at cache length tree_start
        (default: now; parents holds one entry per tree token from there: -1 for a root, else an
        earlier index): row i is bit-identical to feeding token i right after its ancestors.
        Follow with keep_path."""
        return self._forward(token_ids, all_logits=True, parents=np.asarray(parents, np.int32),
                             tree_start=tree_start)

    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Keeps, of a tree fed at cache length `start`, the tokens at offsets (a path from the
        root), forgetting the other branches."""
        kept = [self.cached_tokens[start + i] for i in offsets]
        self.cache.keep_path(start, offsets)
        if self.trail is not None:
            self.trail.keep_path(start, offsets)
        self.cached_tokens[start:] = kept
        self.exact_length = min(self.exact_length, self.cache.length)

    def shift(self, keep: int, num_dropped: int) -> None:
        """Drops the cached tokens [keep, keep + num_dropped) and moves the later ones down, their
        keys rotated to their new positions (KVCache.shift): llama.cpp's context shift."""
        rotations = [(cos[num_dropped], sin[num_dropped]) for cos, sin in self.decoder.rotary]
        self.cache.shift(keep, num_dropped, rotations, self.decoder.config.rope_style == "neox")
        del self.cached_tokens[keep:keep + num_dropped]
        if self.trail is not None:
            self.trail.clear()  # the hidden states were computed at positions that moved
        # a ring that had overwritten kept positions no longer holds what a fresh prefill would
        self.exact_length = min(self.exact_length, keep) if not any(self.cache.held_from) else 0

    def _forward(self, token_ids: list[int], all_logits: bool, parents: np.ndarray | None = None,
                 tree_start: int | None = None) -> np.ndarray:
        start, trail = self.cache.length, self.trail
        on_hidden = None if trail is None else (lambda rows: trail.record(start, rows))
        try:
            logits = self.run_pass(SequenceInput(np.array(token_ids, np.int64), self.cache, all_logits,
                                                 parents, tree_start, on_hidden=on_hidden))
        except torch.OutOfMemoryError as error:
            self._truncate(start)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what the failed pass held goes back, for the next one
            raise BudgetError(f"the GPU ran out of memory in a pass of {len(token_ids)} tokens: its layers "
                              f"leave too little room for activations; lower gpu_memory") from error
        except BaseException:
            self._truncate(start)  # a half-written pass (Ctrl-C, error) leaves the cache as before
            raise
        if self.exact_length == start:  # computed over an exact prefix: exact too
            self.exact_length = self.cache.length
        self.cached_tokens.extend(token_ids)
        return logits

    def _reuse(self, token_ids: list[int], shifted: bool) -> int:
        """How many leading tokens of token_ids the cache holds (shifting it first if allowed)."""
        common = common_prefix(self.cached_tokens, token_ids)
        if not shifted:
            common = min(common, self.exact_length)
        else:
            run_start, run_length = _longest_run(self.cached_tokens, token_ids, common)
            if run_length and self.cache.can_shift and self.cache.can_truncate_to(run_start + run_length):
                self._truncate(run_start + run_length)
                self.shift(common, run_start - common)
                common += run_length
        reused = min(common, len(token_ids) - 1)  # the last prompt token is always recomputed
        return self.cache.reachable(reused)

    def _truncate(self, length: int) -> None:
        self.cache.truncate(length)
        if self.trail is not None:
            self.trail.truncate(length)
        del self.cached_tokens[length:]
        self.exact_length = min(self.exact_length, length)


def common_prefix(cached: list[int], new: list[int]) -> int:
    common = 0
    for a, b in zip(cached, new):
        if a != b:
            break
        common += 1
    return common


def _longest_run(cached: list[int], new: list[int], start: int) -> tuple[int, int]:
    """(b, length) of the longest cached[b:b + length] == new[start:start + length] with b > start:
    what a shift that drops cached[start:b] would reuse; (start, 0) if none. Candidates are
    narrowed one token at a time, the survivors' matches measured at once when one is left."""
    cached_ids, tail = np.asarray(cached, np.int64), np.asarray(new[start:], np.int64)
    if start + 1 >= len(cached_ids) or not len(tail):
        return start, 0
    candidates = np.flatnonzero(cached_ids[start + 1:] == tail[0]) + start + 1
    matched = 1
    while len(candidates) > 1 and matched < len(tail):
        inside = candidates[candidates + matched < len(cached_ids)]
        going_on = inside[cached_ids[inside + matched] == tail[matched]]
        if not len(going_on):
            break
        candidates, matched = going_on, matched + 1
    if not len(candidates):
        return start, 0
    b = int(candidates[0])
    length = min(len(cached_ids) - b, len(tail))
    differs = np.flatnonzero(cached_ids[b:b + length] != tail[:length])
    return b, int(differs[0]) if len(differs) else length


def generate_tokens(generator: TokenGenerator, prompt_ids: list[int], sampler: Sampler,
                    max_tokens: int, stop_ids: frozenset[int], cancel: threading.Event,
                    stats: GenerationStats, speculator=None,
                    on_prefill: PrefillProgress | None = None, shifted: bool = False) -> Iterator[int]:
    """Yields generated token ids (an end-of-generation token ends the loop and is not yielded).

    With a speculator (speculative/speculator.py) each pass verifies a draft's token tree and
    may yield several tokens; greedy output stays the target's own token for token, and sampled
    output follows its distribution exactly.

    The caller stops early by closing the iterator; stats are filled in as it goes; on_prefill
    follows the prompt's prefill; shifted lets it shift the cache (TokenGenerator.prefill).
    """
    stats.prompt_tokens = len(prompt_ids)
    started = time.perf_counter()
    logits, stats.cached_prompt_tokens = generator.prefill(prompt_ids, cancel, progress=on_prefill,
                                                           shifted=shifted)
    stats.prefill_seconds = time.perf_counter() - started
    if logits is None or max_tokens <= 0:  # max_tokens 0: the prompt read, as llama.cpp's n_predict 0
        return
    history = list(prompt_ids)
    chosen = [sampler.sample(logits, history)]  # tokens picked and not yet yielded
    decode_started = time.perf_counter()
    try:
        while True:
            for token in chosen:
                if token in stop_ids:
                    return
                stats.generated_tokens += 1
                history.append(token)
                yield token
                if stats.generated_tokens >= max_tokens or cancel.is_set():
                    return
            room = min(max_tokens - stats.generated_tokens - 1,
                       generator.cache.context_length - generator.cache.length - 1)
            stats.decode_steps += 1
            if speculator is None or room < 1:
                chosen = [sampler.sample(generator.decode_step(history[-1]), history)]
            else:
                accepted, token = speculator.step(generator, history, sampler, room, stats)
                chosen = [*accepted, token]
    finally:
        stats.decode_seconds = time.perf_counter() - decode_started
