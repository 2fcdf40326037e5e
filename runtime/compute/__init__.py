"""tierflow.runtime.compute: the contracts below the decoder, the families and offload/.

    interfaces.py  Kernels, Weights, WeightSource, Experts, LayerPass, Block; activations' helpers
    cpu.py         the CPU's Kernels (the C extension) and DenseLinear, the float32 matmul of a step
"""
