"""Compiles every kernel for a CUDA architecture, no GPU needed, and reports registers and spills.

    python -m tierflow.gpu_kernels.compile_check [--arch 80] [--all-configs]

Triton's interpreter, which runs the tests without a GPU, accepts code the compiler refuses (and
says nothing of registers), so this builds each kernel through ptxas (bundled with Triton) for the
given compute capability: one representative config per kernel and layout, or every autotuning
config with --all-configs. A spill (local memory) is printed as a warning: a config that spills
is slow, and the autotuner's pruning (matmul_kernels.fitting_configs) should drop it.
Run it without TRITON_INTERPRET: the kernels must be defined for the compiler.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tierflow.cpu_kernels.hadamard import rotation_sizes
from tierflow.gpu_kernels import attention_kernels, matmul_kernels, ops_kernels
from tierflow.kv_types import KV_TYPES

MATRIX = {"x": "*fp16", "data": "*u8", "high": "*u8", "scales": "*fp16", "mins": "*fp16", "codebook": "*i8",
          "sub_codes": "*u8", "sub_supers": "*fp16", "out": "*fp16", "M": "i32", "N": "i32", "N_OUT": "i32",
          "K": "i32", "stride_x": "i32"}


def matrix_form(bits: int, width: int = 8, zero: int = 0, codebook: bool = False, mins: str = "none",
                sub: tuple[int, int, int] = (0, 0, 1), group: int = 32) -> dict:
    """The layout constexprs of the matrix kernels; sub: SUB_BITS, SUB_OFFSET, SUB_GPS."""
    return dict(GROUP=group, BITS=bits, WIDTH=width, ZERO=zero, CODEBOOK=codebook, MINS=mins,
                SUB_BITS=sub[0], SUB_OFFSET=sub[1], SUB_GPS=sub[2])


# (layout, silu, x dtype): one of each way of reading codes and scales, by a GGUF type that has it
MATRIX_BUILDS = [
    (matrix_form(3, mins="half"), True, "*fp16"),  # LUT codes with float16 mins
    (matrix_form(8), False, "*fp32"),  # Q8_0
    (matrix_form(8, codebook=True), True, "*fp16"),  # IQ4_NL
    (matrix_form(8, width=5, zero=16), False, "*fp16"),  # Q5_0
    (matrix_form(8, width=4, mins="sub", sub=(6, 0, 8)), True, "*fp16"),  # Q4_K
    (matrix_form(8, width=6, zero=32, sub=(8, 128, 16), group=16), True, "*bf16"),  # Q6_K
    (matrix_form(3, zero=4, mins="zero", sub=(6, 32, 16), group=16), False, "*fp16"),  # Q3_K
    (matrix_form(2, mins="sub", sub=(4, 0, 16), group=16), True, "*fp16"),  # Q2_K
]
ATTENTION = {name: "*fp32" for name in ("qkv", "keys", "values", "cos", "sin", "out", "partials", "stats")}
ATTENTION |= {"start": "i32", "H": "i32", "KVH": "i32", "C": "i32", "scale": "fp32", "BASE": "i32",
              "SPLIT_SIZE": "i32", "NUM_SPLITS": "i32", "WINDOW": "i32", "HELD_FROM": "i32",
              "softcap": "fp32", "sinks": "*fp32"}


def variants(all_configs: bool) -> list[tuple]:
    """(kernel, signature, constexprs, options) of each build."""
    builds = []
    for form, silu, x in MATRIX_BUILDS:
        int8 = form["BITS"] == 8 and form["WIDTH"] == 8 and not form["CODEBOOK"]
        layout = {"data": "*i8" if int8 else "*u8", "x": x, "out": x}
        flags = form | dict(SILU_MUL=silu)
        matvec = matmul_kernels.fitting_configs(matmul_kernels.MATVEC_CONFIGS, flags)
        for config in matvec if all_configs else matvec[:1]:
            builds.append((matmul_kernels.matvec_kernel, MATRIX | layout | {"K_PER_SPLIT": "i32"},
                           flags | dict(SPLIT_K=2, **config.kwargs), dict(num_warps=config.num_warps)))
        for config in matmul_kernels.MATMUL_CONFIGS if all_configs else matmul_kernels.MATMUL_CONFIGS[:1]:
            builds.append((matmul_kernels.matmul_kernel, MATRIX | layout | {"M_BUCKET": "i32"},
                           flags | dict(F32=x == "*fp32", **config.kwargs),
                           dict(num_warps=config.num_warps, num_stages=config.num_stages)))
    attention_builds = [(128, True, True, "q8_0", False, False), (80, False, False, "f32", True, False),
                        (64, True, True, "q4_0", False, True), (96, False, True, "f16", False, False)]
    for head_dim, neox, split, kv, softcap, sinks in attention_builds:  # sinks: gpt-oss's
        shape = dict(D=head_dim, HALF=head_dim // 4, GROUP=4, NEOX=neox, SPLIT=split, SOFTCAP=softcap,
                     SINKS=sinks, BLOCK_G=16, BLOCK_S=attention_kernels.BLOCK_S,
                     BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()), KV=attention_kernels.KV_CODES[kv])
        shape |= dict(zip(("ROT_K", "ROT_V"), rotation_sizes(KV_TYPES[kv], head_dim)))  # q8_0, q4_0: on
        rows = {"f32": "*fp32", "f16": "*fp16"}.get(kv, "*u8")
        builds.append((attention_kernels.attention_kernel, ATTENTION | {"keys": rows, "values": rows}, shape,
                       dict(num_warps=4)))
    builds.append((attention_kernels.merge_splits_kernel,
                   {"partials": "*fp32", "stats": "*fp32", "out": "*fp32", "NUM_SPLITS": "i32"},
                   dict(D=128, BLOCK_SPLITS=64, BLOCK_D=128), dict(num_warps=4)))
    builds.append((ops_kernels.rms_norm_kernel, {"x": "*fp32", "residual": "*fp32", "weight": "*fp32",
                                                 "out": "*fp32", "E": "i32", "eps": "fp32"},
                   dict(HAS_RESIDUAL=True, BLOCK_E=8192), dict(num_warps=16)))
    builds.append((ops_kernels.silu_mul_kernel, {"gate_up": "*bf16", "out": "*bf16", "F": "i32"},
                   dict(BLOCK_F=1024), dict(num_warps=4)))
    return builds


def compile_one(kernel, signature: dict, constexprs: dict, options: dict, arch: int) -> str:
    """Builds one variant; returns ptxas' resource line ('' where cuobjdump is not at hand)."""
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    source = ASTSource(fn, signature | {name: "constexpr" for name in constexprs}, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True)
        usage = report.stdout
    return next((line.strip() for line in usage.splitlines() if "REG:" in line), "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=80, help="compute capability, e.g. 75, 80, 86, 89, 90")
    parser.add_argument("--all-configs", action="store_true", help="every autotuning config")
    args = parser.parse_args(argv)
    if getattr(matmul_kernels, "INTERPRETED", False):
        sys.exit("TRITON_INTERPRET is set: unset it to compile the kernels")
    for kernel, signature, constexprs, options in variants(args.all_configs):
        usage = compile_one(kernel, signature, constexprs, options, args.arch)
        status = "SPILLS" if usage and "STACK:0 " not in usage else "ok"
        name = (kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel).__name__
        shown = {k: v for k, v in constexprs.items()
                 if k in ("BITS", "WIDTH", "MINS", "SUB_BITS", "SILU_MUL", "D") or k[:5] == "BLOCK"}
        print(f"{status:<7}{name:<20} {shown} {options}  {' '.join(usage.split()[:2])}")


if __name__ == "__main__":
    main()
