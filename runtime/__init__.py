"""tierflow.runtime: the engine, the decoder and what turns text into tokens and back.

    engine.py         Engine: load, generate, stream, chat, score (sync, streaming, async, cancellable)
    arguments.py      checks of the public API's arguments (ids, stop strings, flags, UTF-8 text)
    loader.py         the one loader: budgets, plan, pack, weights (Engine.load, drafts, plan, info)
    models/           one file per model family: its config, tensor map and block
    model.py          the decoder loop, the Kernels protocol, Weights, the CPU kernels' bindings
    generation.py     the token loop: prefill, decode, verify passes, prefix reuse, shifted-cache reuse
    hidden_trail.py   a sequence's final-normed hidden states by cache slot, for an MTP draft to read
    streams.py        a generation as an object: Stream, AsyncStream
    embeddings.py     engine.embed: pooled hidden states, several inputs in one pass
    kv_cache.py       the KV cache and its context shift; rope.py the rotary tables
    recurrent_state.py  a linear-attention layer's state in the cache: records, replays, checkpoints
    delta_rule.py     the gated delta rule (Gated DeltaNet's recurrence): token by token and chunked
    context_shift.py  which turns a conversation that outgrows the context drops (chat and server)
    host_attention.py a device layer's attention over a cache in RAM (kv_on_cpu)
    sampler.py        sampling settings and the sampler (logit bias, penalties, filters, a constraint's mask)
    logprobs.py       each generated token's log-probability and top alternatives
    structured.py     structured output: grammars (JSON schema, regex, Lark, GBNF) and their matchers
    schema_checks.py  a JSON schema too wide for the grammar engine, or with no finite instance, refused
    batching.py       the passes of generations running together, batched into one sweep of the weights
    slots.py          the sequences decoded together: their token generators and who holds which
    tokenizer.py      llama.cpp's tokenizer; vocabulary.py checks a vocabulary before it loads
    chat_template.py  chat templates in a sandbox (template_guards.py, template_worker.py)
    template_choice.py  which template chats use: the file's, a Jinja file, or a llama.cpp built-in name
    tool_prompt.py    tools and tool history for the template; the generic fallback; a required call's grammar
    tool_calls.py     the model's tool calls parsed from its text, per format; the streaming splitter
    text_stream.py    token bytes to text pieces, stop strings
    config.py         ModelConfig and typed metadata reads; overhead.py the per-layer fixed cost
    model_info.py     what `tierflow info` shows
"""
