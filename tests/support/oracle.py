"""llama.cpp (through llama-cpp-python) as the oracle the tests compare tierflow with."""

from pathlib import Path

import numpy as np


def llama_cpp_model(path: Path, n_ctx: int = 512, f32_kv: bool = False, cache_type: int | None = None):
    """llama.cpp on the same file, with logits kept for every position.

    One thread: ggml's spinning thread barrier slows a hundredfold when another process holds a
    core. Its KV cache is float16 unless f32_kv, which makes float32 weights an exact oracle, or
    cache_type (a GGML_TYPE_*), with flash attention, which llama.cpp needs for a quantized V.
    """
    from llama_cpp import GGML_TYPE_F32, Llama

    kv_type = GGML_TYPE_F32 if f32_kv else cache_type
    return Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=1,
                 verbose=False, seed=0, type_k=kv_type, type_v=kv_type, flash_attn=cache_type is not None)


PROMPTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the largest planet in the solar system?\nA:",
]
LONG_TEXT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "into chemical energy. Inside the chloroplasts, chlorophyll absorbs mostly blue and red "
    "light, and the energy splits water molecules, releasing oxygen. The captured energy is "
    "stored in ATP and NADPH, which the Calvin cycle then uses to fix carbon dioxide into sugars."
)


def long_prompt(sentences: int) -> str:
    """A prompt of about 20 tokens a sentence, none of them repeated whole."""
    return " ".join(f"Sentence {i}: the river bends past mill number {i * 7 % 13}." for i in range(sentences))


# Logits. llama.cpp's 8-bit activations move the bundled Q4_1 model's logits by 0.17 on average;
# the gap between two candidates moves by 0.12 on average, 0.53 at the 99th percentile and 0.8 at
# most (measured over 500 positions): a smaller lead than that is llama.cpp's coin flip.
NEAR_TIE = 0.8
EXACT_TIE = 1e-3  # float32 summation order


def llama_cpp_mtp_logits(path: Path, ids: list[int], hidden: np.ndarray) -> tuple[np.ndarray, bool]:
    """The logits of llama.cpp's multi-token-prediction graph (graph_mtp, in a context of type MTP)
    over ids at positions 0, 1, ..., each beside its row of hidden [T, E], and whether llama.cpp
    took those rows. This build's llama_batch_ext_set_embd_state stores nothing and returns false:
    the graph reads its state input as its buffer was allocated, zeros in a process's first
    buffer, whatever an earlier context left in one whose memory malloc hands out again; so each
    call runs in a process of its own. One thread, float32 KV cache, no flash attention."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_mtp_logits_here, (str(path), ids, np.asarray(hidden, np.float32)))


def _mtp_logits_here(path: str, ids: list[int], hidden: np.ndarray) -> tuple[np.ndarray, bool]:
    import ctypes

    import llama_cpp as L

    params = L.llama_model_default_params()
    params.load_mtp = True
    quiet = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(quiet, None)
    model = L.llama_model_load_from_file(path.encode(), params)
    context = batch = None
    try:
        settings = L.llama_context_default_params()
        settings.n_ctx = settings.n_batch = settings.n_ubatch = max(64, len(ids))
        settings.n_threads = settings.n_threads_batch = 1
        settings.type_k = settings.type_v = L.GGML_TYPE_F32
        settings.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        settings.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        context = L.llama_init_from_model(model, settings)
        batch = L.llama_batch_ext_init(context)
        rows = np.ascontiguousarray(hidden, np.float32)
        took = []
        for position, token in enumerate(ids):
            index = L.llama_batch_ext_add_token(batch, 0, token)
            L.llama_batch_ext_set_pos(batch, index, ctypes.byref(L.llama_pos(position)))
            row = rows[position].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            took.append(L.llama_batch_ext_set_embd_state(batch, index, L.llama_embd(row, 1, rows.shape[1])))
            L.llama_batch_ext_set_output_logits(batch, index, True)
        if L.llama_process(context, L.LLAMA_PROCESS_TYPE_DECODE, batch) != 0:
            raise RuntimeError("llama.cpp's MTP pass failed")
        vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        logits = np.array([np.ctypeslib.as_array(L.llama_get_logits_ith(context, i), shape=(vocab,))
                           for i in range(len(ids))])
        return logits, all(took)
    finally:
        if batch is not None:
            L.llama_batch_ext_free(batch)
        if context is not None:
            L.llama_free(context)
        L.llama_model_free(model)


def llama_cpp_logits(llama, ids: list[int]) -> np.ndarray:
    llama.reset()
    llama.eval(ids)
    return np.array(llama.scores[: len(ids)], dtype=np.float32)


def llama_cpp_greedy(llama, ids: list[int], max_tokens: int, eog_ids) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy tokens, and at each step the margin between its top two logits."""
    llama.reset()
    llama.eval(ids)
    tokens, margins = [], []
    while len(tokens) < max_tokens:
        scores = np.array(llama.scores[llama.n_tokens - 1])
        second, first = np.argsort(scores)[-2:]
        if first in eog_ids:
            break
        tokens.append(int(first))
        margins.append(float(scores[first] - scores[second]))
        llama.eval([int(first)])
    return tokens, margins


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[T, V] float32 -> float64 log-probabilities."""
    logits = logits.astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def perplexity(log_probs: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-probability of each next token of the text."""
    next_ids = np.array(ids[1:])
    return float(np.exp(-log_probs[np.arange(len(next_ids)), next_ids].mean()))


def top2_margin(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def assert_logits_agree(engine, llama, ids, max_mean_diff: float, near_tie: float) -> float:
    """The logits agree within max_mean_diff on average, and the top tokens wherever both sides see
    a margin above near_tie: where either sees a tie, its own rounding may have decided it (a
    quantized qwen3's position whose exact margin is 0.38 read 1.28 in llama.cpp)."""
    ours, theirs = engine.logits(ids), llama_cpp_logits(llama, ids)
    assert ours.shape == theirs.shape == (len(ids), engine.config.vocab_size)
    mean_abs_diff = float(np.abs(ours - theirs).mean())
    decided = np.minimum(top2_margin(theirs), top2_margin(ours)) > near_tie
    assert np.array_equal(ours.argmax(-1)[decided], theirs.argmax(-1)[decided])
    assert mean_abs_diff < max_mean_diff, mean_abs_diff
    return mean_abs_diff


def assert_moe_agrees_but_where_routing_is_a_near_tie(engine, llama, ids) -> float:
    """A quantized mixture of experts against llama.cpp: each side's 8-bit activations (rounded its
    own way) flip a router's choice where the k-th and (k+1)-th expert nearly tie, and at those few
    positions (1-6 of 64 measured) the logits differ by 1-6; elsewhere they agree within the
    quantization noise of dense models. (Olmoe in Q4_K against its float32 copy: tierflow's median
    error 0.19 with 5 such positions, llama.cpp's 0.27 with 3.) Returns the median |logit
    difference| per position."""
    ours, theirs = engine.logits(ids), llama_cpp_logits(llama, ids)
    per_position = np.abs(ours - theirs).mean(-1)
    decided = top2_margin(theirs) > 1.0
    assert np.median(per_position) < 0.35 and (per_position > 1.0).mean() <= 0.1
    assert (ours.argmax(-1)[decided] == theirs.argmax(-1)[decided]).mean() >= 0.95
    return float(np.median(per_position))


def llama_cpp_own_spread(llama, ids: list[int]) -> tuple[float, float]:
    """How far llama.cpp's logits of `ids` move between two ways it computes them: one batch, and
    token by token (other kernels, other rounding of the 8-bit activations). Returns the mean
    |logit difference| and the largest change of the top-2 margin: the noise of llama.cpp itself
    on this very input, which bounds what a comparison with it can ask."""
    batch = llama_cpp_logits(llama, ids)
    llama.reset()
    steps = []
    for token in ids:
        llama.eval([token])
        steps.append(np.array(llama.scores[llama.n_tokens - 1], dtype=np.float32))
    steps = np.array(steps)
    rows, order = np.arange(len(ids)), np.argsort(batch, axis=-1)
    first, second = order[:, -1], order[:, -2]
    margins = [logits[rows, first] - logits[rows, second] for logits in (batch, steps)]
    return float(np.abs(batch - steps).mean()), float(np.abs(margins[0] - margins[1]).max())


def assert_greedy_agrees(engine, llama, prompt: str | list[int], near_tie: float, max_tokens: int = 64):
    """tierflow's greedy tokens are llama.cpp's, but where llama.cpp's choice is a near-tie.

    Along llama.cpp's greedy path, tierflow's next-token argmax (from one batched pass) must be
    llama.cpp's token at every decided step. tierflow's own greedy generation (the decode path)
    must follow the same tokens until it first parts from them, which only a near-tie excuses.
    """
    ids = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
    theirs, margins = llama_cpp_greedy(llama, ids, max_tokens, engine.tokenizer.eog_ids)
    along_path = engine.logits(ids + theirs)[len(ids) - 1 : len(ids) - 1 + len(theirs)].argmax(-1)
    decided = np.array(margins) > near_tie
    assert np.array_equal(along_path[decided], np.array(theirs)[decided])
    ours = engine.generate(ids, max_tokens=max_tokens, temperature=0).tokens
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if parted is None:
        assert ours == theirs
    else:
        assert not decided[parted], f"parted from llama.cpp at step {parted}, not a near-tie"
    return int(decided.sum())
