"""tierflow.runtime: the engine, as folders in the path of a request (docs/ARCHITECTURE.md).

    api/         Engine and its streams: what a user calls; embeddings; `tierflow info`
    text/        text to tokens and back: tokenizer, chat templates, tool prompts and calls, stop strings
    generation/  the token loop and the scheduler (SlotPool, PassBatcher); the context shift's turns
    sampling/    logits to a token: the sampler, its logits processors, grammars, logprobs
    loading/     the one loader: budgets, plan, pack, weights; the per-layer overhead
    decoder/     one forward pass over the layers; rotary tables; attention over a cache in RAM
    models/      one file per model family, ModelConfig and the tensor maps: the model specs
    memory/      what a sequence keeps: each layer's kind of memory, the KV cache, recurrent states
    compute/     the contracts below them all (Kernels, Weights, WeightSource, ...) and the CPU's kernels
"""
