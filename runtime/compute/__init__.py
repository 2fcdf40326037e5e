"""tierflow.runtime.compute: the contracts below the decoder, the families and offload/.

    interfaces.py  Kernels, Weights, WeightSource, Experts, LayerPass, Block; activations' helpers
    cpu.py         the CPU's Kernels (the C extension) and DenseLinear, the float32 matmul of a step
    delta_rule.py  Gated DeltaNet's recurrence, and the short causal convolution recurrent layers share
    selective_scan.py  Mamba's selective scan, token by token and chunked
"""
