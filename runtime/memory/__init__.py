"""tierflow.runtime.memory: what a sequence keeps between passes.

    kv_cache.py         the KV cache of every layer: full, sliding-window ring, latent rows; its shift
    recurrent_state.py  a linear-attention layer's state: records, replays, checkpoints
    hidden_trail.py     a sequence's final-normed hidden states by cache slot, for an MTP draft
"""
