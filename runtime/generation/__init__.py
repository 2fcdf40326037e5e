"""tierflow.runtime.generation: the token loop and the scheduler that runs sequences together.

    token_loop.py     prefill, decode, verify passes, prefix reuse, shifted-cache reuse
    stats.py          what a generation measured (GenerationStats), a prefill's progress callback
    slots.py          the scheduler's sequences: SlotPool, who holds which slot and its KV cache
    batching.py       the scheduler's passes: PassBatcher runs the passes of several slots as one sweep
    context_shift.py  which turns a conversation that outgrows the context drops (chat and server)
"""
