"""tierflow.runtime.decoder: one forward pass over the layers, with no placement.

    decoder.py         the decoder loop: embeddings, each layer's block, the head; batches of sequences
    rope.py            the rotary tables per layer
    host_attention.py  a device layer's attention over a cache in RAM (kv_on_cpu)
"""
