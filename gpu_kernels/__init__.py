"""tierflow.gpu_kernels: fused Triton kernels on the packed layout, each beside a torch reference.

    packed.py             DeviceMatrix: a PackedMatrix's bytes as device tensors (to_device,
                          view_matrix: views into an uploaded layer, no re-layout)
    matmul.py             matmul (decode: matrix-vector, split-K; prefill: tensor cores),
                          matmul_silu_mul (gate/up with the SwiGLU epilogue), DeviceLinear
    ops.py                rms_norm, add_rms_norm (residual add + norm), silu_mul
    attention.py          attention: rotary + KV-cache write + causal GQA attention, one launch
    reference.py          the torch reference of each (any device): the tests' oracle, the fallback
    launch.py             lazy Triton loading, layout and device checks before every launch
    *_kernels.py          the Triton code; with compile_check.py (builds every kernel for a CUDA
                          architecture through ptxas, no GPU needed), the only modules importing triton

Importing this package, or any launcher, does not import Triton: the first kernel call does, and
without Triton it raises TritonUnavailableError.
"""
