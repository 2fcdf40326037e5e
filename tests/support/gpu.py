"""The GPU kernels for a test module: on CUDA, else in Triton's interpreter, else the module skips."""

import importlib.util

import pytest
import torch


def load_gpu_kernels_or_skip() -> bool:
    """Loads the GPU kernels, in Triton's interpreter without CUDA (before anything imports
    Triton: the interpreter is chosen when it is imported), or skips the calling test module.
    Returns whether CUDA is there."""
    from tierflow.gpu_kernels.launch import TritonUnavailableError, load_all_kernels

    if importlib.util.find_spec("triton") is None:
        pytest.skip("the GPU kernels need triton", allow_module_level=True)
    cuda = torch.cuda.is_available()
    try:
        load_all_kernels(interpret=not cuda)
    except (RuntimeError, TritonUnavailableError) as error:
        pytest.skip(f"the GPU kernels cannot be loaded here: {error}", allow_module_level=True)
    return cuda
