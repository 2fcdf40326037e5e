"""llama.cpp's own batched decoding, driven through llama-cpp-python's low-level API as llama-server
drives its slots: N sequences in one context (n_seq_max = N), each prompt prefilled, then one
llama_decode per step holding every sequence's next token. The baseline of benchmarks/serve.py's
--clients, measured in the same run.

    python -m benchmarks.llama_batched [--model PATH] [--clients 1,2,4,8] [--tokens 64] [--threads 2]
"""

import argparse
import ctypes
import logging
import time

import llama_cpp
import numpy as np

from tierflow.offload.store.model_path import resolve_model_path

PROMPTS = ["Write a story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe a walk through a forest in autumn.", "Tell me about the history of bread.",
           "Write a letter to a friend about a trip to the mountains.", "Explain why the sky is blue.",
           "Describe the life of a honeybee.", "Write a story about a robot learning to paint."]


class BatchedLlama:
    """A llama.cpp context of `sequences` sequences (each `context` positions) over one model."""

    def __init__(self, path: str, sequences: int, context: int, threads: int):
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_seq_max = sequences * context, 512, sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.batch = llama_cpp.llama_batch_init(512, 0, sequences)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        ids = (llama_cpp.llama_token * (len(data) + 8))()
        count = llama_cpp.llama_tokenize(self.vocab, data, len(data), ids, len(ids), True, False)
        return list(ids[:count])

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
            batch.seq_id[i][0] = sequence
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(self, index: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(self.ctx, index)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)),
                                                   (self.n_vocab,))))

    def generate_together(self, prompts: list[list[int]], tokens: int) -> float:
        """Aggregate generated tokens/s of the prompts' greedy continuations, decoded together
        (end tokens not honoured: every sequence runs `tokens` steps)."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        started = time.perf_counter()
        entries = [(token, position, s, position == len(ids) - 1)
                   for s, ids in enumerate(prompts) for position, token in enumerate(ids)]
        self.decode(entries)
        outputs = [i for i, entry in enumerate(entries) if entry[3]]
        positions = [len(ids) for ids in prompts]
        for _ in range(tokens):
            chosen = [self.greedy(i) for i in outputs]
            self.decode([(token, positions[s], s, True) for s, token in enumerate(chosen)])
            outputs = list(range(len(prompts)))
            positions = [p + 1 for p in positions]
        return len(prompts) * tokens / (time.perf_counter() - started)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def batched_rates(model: str | None, counts: list[int], tokens: int, threads: int) -> dict[int, float]:
    """llama.cpp's aggregate tok/s for each count of sequences decoded together."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # as Llama(verbose=False) quiets it
    llama = BatchedLlama(str(resolve_model_path(model)), max(counts), 1024, threads)
    try:
        prompts = [llama.tokenize(text) for text in PROMPTS]
        llama.generate_together(prompts[:1], 4)  # warm-up
        return {n: llama.generate_together([prompts[i % len(prompts)] for i in range(n)], tokens)
                for n in counts}
    finally:
        llama.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    counts = sorted({1, *(int(n) for n in args.clients.split(","))})
    rates = batched_rates(args.model, counts, args.tokens, args.threads)
    print(f"llama.cpp batched decoding; threads {args.threads}; {args.tokens} tokens per sequence")
    print(f"{'sequences':>10}{'aggregate tok/s':>17}{'x one':>8}")
    for n in counts:
        print(f"{n:>10}{rates[n]:>17.1f}{rates[n] / rates[1]:>7.2f}x")


if __name__ == "__main__":
    main()
