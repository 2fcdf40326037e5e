"""tierflow.offload: where the weights live and how they move, as a pipeline of folders.

    store/     the models on this disk by name (ollama's, Hugging Face's, LM Studio's stores, presets),
               pulled from Hugging Face, removed; the file `-m` means
    gguf/      the file: a validating GGUF reader, the model it holds (family, config, tensors
               checked against the family's map), `tierflow convert`
    pack/      the pack: the GGUF's weights re-laid out once for the kernels, one extent per
               layer (and per expert), and the sizes of that layout before anything is packed
    plan/      the plan: budgets, the hardware profile (probe), the cost model, and the planner
               that places every layer (and expert) on the GPU, in RAM or on disk
    io/        moving bytes: O_DIRECT reads, reusable aligned buffers, the layer streamer
    tiers/     the weights as placed: TieredWeights (the decoder's WeightSource) and the GPU tier
    experts/   mixture-of-experts: the expert cache, its policies, next-layer prediction, and the
               two tiers that serve experts through a cache (streamed from disk, hybrid CPU-GPU)

Lower layers never call upward: nothing here imports the Engine. What a model family is comes
from tierflow.runtime.models; the decoder that computes with the weights is tierflow.runtime.
"""
