"""What every launcher shares: loading the Triton kernels lazily, and checking tensors before a launch.

Triton is optional: nothing in tierflow imports it until a kernel is first called, and then a
missing Triton is a `TritonUnavailableError` that says how to get it. A Triton kernel runs on CUDA
tensors, or on CPU tensors when it was defined under `TRITON_INTERPRET=1` (Triton's interpreter,
how the tests run the kernels without a GPU); any other device is refused before the launch, since
Triton would fail on it far less clearly.
"""

import importlib
import os
import sys
from types import ModuleType

import torch

from tierflow.errors import TierflowError

TRITON_REQUIREMENT = "triton>=3.2"
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TritonUnavailableError(TierflowError, ImportError):
    """A GPU kernel was called but Triton cannot be imported."""


def interpreting() -> bool:
    """Whether kernels defined now run in Triton's interpreter (read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def load_kernels(name: str) -> ModuleType:
    """The module of Triton kernels `tierflow.gpu_kernels.<name>`, imported on first use."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise TritonUnavailableError(f"tierflow's GPU kernels need Triton: pip install "
                                     f"'{TRITON_REQUIREMENT}' (Linux x86-64 with an NVIDIA GPU); without it, "
                                     f"use the torch path in tierflow.gpu_kernels.reference") from error
    return importlib.import_module(f"tierflow.gpu_kernels.{name}")


KERNEL_MODULES = ("matmul_kernels", "ops_kernels", "attention_kernels")


def load_all_kernels(interpret: bool = False) -> None:
    """Imports every kernel module now; with interpret, for Triton's interpreter, which runs them
    on CPU tensors (the tests; a CPU stand-in for the GPU).

    The interpreter is a mode of the whole process: Triton reads TRITON_INTERPRET when it is
    imported, when a kernel is defined and again in imports it makes at a kernel's first call, so
    the variable is set for good, and Triton must not have been imported before without it.
    """
    if interpret and not interpreting():
        if "triton" in sys.modules:
            raise RuntimeError("Triton was imported before TRITON_INTERPRET was set: its interpreter "
                               "cannot be switched on any more in this process")
        os.environ["TRITON_INTERPRET"] = "1"
    for name in KERNEL_MODULES:
        load_kernels(name)


def check_device(kernels: ModuleType, **tensors: torch.Tensor | None) -> torch.device:
    """The one device of `tensors` (None entries skipped), which the kernels can run on."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")
    device = next(iter(devices.values()))
    if device.type == "cpu" and not kernels.INTERPRETED:
        raise ValueError("Triton kernels need CUDA tensors (CPU tensors only under TRITON_INTERPRET=1, set "
                         "before the kernels are first loaded)")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"Triton kernels cannot run on {device}")
    return device


def check_tensor(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...],
                 shape: tuple[int | None, ...]) -> None:
    """A TypeError for a dtype not in `dtypes`, a ValueError for a shape not `shape` (None: any
    size) or a tensor that is not contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, not {str(tensor.dtype).removeprefix('torch.')}")
    wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        raise ValueError(f"{name} must be {wanted}, not {list(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (4 under the interpreter: few programs run faster)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def power_of_two(size: int) -> int:
    """The least power of two >= size: a Triton block's length must be one."""
    return 1 << max(0, size - 1).bit_length()
