"""Embeddings: one vector per input, pooled from the final-normed hidden states, as llama.cpp's
embeddings mode computes them (llama-graph.cpp build_pooling, the hidden states `result_norm`).

The pooling is the one the model file declares (`{arch}.pooling_type`, llama.cpp's enum), else
the mean over the input's tokens; a text's tokens are those llama.cpp embeds (BOS and EOS as the
vocabulary adds them: Tokenizer.encode_for_embedding).

Inputs are batched: those that fit in one pass together (MAX_PASS_TOKENS, the activations the
budget holds, and no more than the cache's positions) go as independent root chains of one token
tree, each seeing only its own tokens at its own positions (Decoder.forward with parents), and get
the bits they would alone (the decoder is batch-invariant). A longer input runs alone, in chunks,
pooled as they come. The pass writes the engine's own KV cache, which the generator then forgets
(its prefix reuse starts over): no second cache beyond the planned one.

Shape legend: N inputs, T tokens of a pass, E hidden size.
"""

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from tierflow.errors import BudgetError, UnsupportedModelError
from tierflow.kv_types import MAX_PASS_TOKENS
from tierflow.runtime.decoder.decoder import SequenceInput
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.models.config import Metadata

POOLINGS = ("none", "mean", "cls", "last", "rank")  # llama.cpp's llama_pooling_type, by value


def model_pooling(metadata: Mapping[str, Any], arch: str) -> str:
    """The pooling the file declares ({arch}.pooling_type), "mean" if it declares none: a
    generative model's file usually does not, and llama.cpp's users ask for mean then."""
    meta = Metadata(metadata, arch)
    if not meta.has("pooling_type"):
        return "mean"
    return POOLINGS[meta.count("pooling_type", minimum=0, maximum=len(POOLINGS) - 1)]


def check_pooling(pooling: str, model_name: str) -> None:
    """Refuses the poolings that give no single vector per input from the hidden states."""
    if pooling == "none":
        raise UnsupportedModelError(f"{model_name} declares pooling_type none (one vector per token); "
                                    f"embed() gives one per input and does not support it")
    if pooling == "rank":
        raise UnsupportedModelError(f"{model_name} declares pooling_type rank (a reranker's "
                                    f"classification head); embed() does not support it")


def embed_inputs(generator: TokenGenerator, inputs: list[list[int]], pooling: str,
                 normalize: bool) -> np.ndarray:
    """The pooled vectors [N, E] float32 of inputs (token ids, each non-empty and within the
    context), L2-normalised if normalize (a zero vector stays zero, as llama.cpp's). Leaves the
    generator's cache empty."""
    pooled = np.empty((len(inputs), generator.decoder.config.hidden_size), np.float32)
    generator.keep(0)
    try:
        # a tree's tokens take a cache slot each: a pass holds no more than the cache does
        pass_tokens = min(MAX_PASS_TOKENS, generator.cache.context_length)
        for batch in pass_batches([len(ids) for ids in inputs], pass_tokens):
            if len(batch) == 1:
                pooled[batch[0]] = _pool(_hidden_chunks(generator, inputs[batch[0]]), pooling)
            else:
                pooled[batch] = _embed_together(generator, [inputs[i] for i in batch], pooling)
    except torch.OutOfMemoryError as error:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the failed pass held goes back, for the next one
        raise BudgetError("the GPU ran out of memory in an embedding pass: its layers leave too little "
                          "room for activations; lower gpu_memory") from error
    finally:
        generator.keep(0)
    if normalize:
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)  # [N, 1]
        pooled /= np.where(norms > 0, norms, 1)
    return pooled


def pass_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the inputs, in order, grouped into passes of at most max_tokens tokens; an input
    longer than that is a batch of its own."""
    batches, batch, size = [], [], 0
    for i, length in enumerate(lengths):
        if batch and size + length > max_tokens:
            batches.append(batch)
            batch, size = [], 0
        batch.append(i)
        size += length
    return batches + [batch] if batch else batches


def _embed_together(generator: TokenGenerator, inputs: list[list[int]], pooling: str) -> np.ndarray:
    """One pass over inputs as root chains of a token tree from an empty cache: [len(inputs), E]."""
    lengths = [len(ids) for ids in inputs]
    starts = np.cumsum([0, *lengths[:-1]])
    # each chain's first token a root, every other token the child of the one before it
    parents = np.arange(-1, sum(lengths) - 1, dtype=np.int32)
    parents[starts] = -1
    hidden = generator.run_pass(SequenceInput(np.concatenate(inputs).astype(np.int64), generator.cache,
                                              parents=parents, tree_start=0, head=False))  # [T, E]
    generator.cache.truncate(0)
    return np.stack([_pool(iter([rows]), pooling) for rows in np.split(hidden, starts[1:])])


def _hidden_chunks(generator: TokenGenerator, ids: list[int]) -> Iterator[np.ndarray]:
    """The final-normed hidden states of one input, a pass's worth [T, E] at a time."""
    for start in range(0, len(ids), MAX_PASS_TOKENS):
        chunk = np.asarray(ids[start:start + MAX_PASS_TOKENS], np.int64)
        yield generator.run_pass(SequenceInput(chunk, generator.cache, head=False))
    generator.cache.truncate(0)


def _pool(chunks: Iterator[np.ndarray], pooling: str) -> np.ndarray:
    """One input's vector [E] from its hidden states, given in consecutive chunks [T, E]."""
    total, count, first, last = 0.0, 0, None, None
    for rows in chunks:
        if first is None:
            first = rows[0].copy()
        last = rows[-1]
        if pooling == "mean":
            total, count = total + rows.sum(axis=0, dtype=np.float64), count + len(rows)
    if pooling == "cls":
        return first
    if pooling == "last":
        return last
    return (total / count).astype(np.float32)
