"""tierflow.offload.tiers: the weights as a plan places them.

    tiered.py   TieredWeights: the decoder's WeightSource, layers on the GPU tier, in RAM or streamed,
                a MoE model's experts resident or served by an expert tier
    device.py   DeviceTier: the GPU's memory under gpu_memory, pinned staging and a copy stream
"""
