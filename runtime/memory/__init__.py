"""tierflow.runtime.memory: what a sequence keeps between passes.

    kinds.py            each layer's kind of memory: full, ring, latent, recurrent; their sizes
    kv_cache.py         a sequence's memory: its kinds behind one protocol (a pass, going back, a shift)
    attention_rows.py   the attention layers' key and value rows: full, sliding-window ring, latent
    recurrent_state.py  a recurrent layer's state (linear attention, Mamba): records, replays, checkpoints
    state_shapes.py     the sizes of those states: Gated DeltaNet's, Mamba's
    hidden_trail.py     a sequence's final-normed hidden states by cache slot, for an MTP draft
"""
