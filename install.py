"""Installs tierflow with a llama.cpp that runs on the CPU it lands on.

llama-cpp-python builds llama.cpp from source, by default with `-march=native`. A CPU that
advertises AMX which its virtual machine does not enable gets tile instructions that fault on
first use, and every oracle test dies with the process. So on x86-64 Linux this builds llama.cpp
with GGML_NATIVE off and each instruction set this CPU lists turned on by name, AMX excepted:
llama.cpp keeps its AVX-512, VNNI and repacked kernels, its best speed here without the tiles.

pip caches the wheel it built under the sdist's name, whatever flags built it, so a build that
still carries AMX (a cached native one, say) is rebuilt without the cache.

    python install.py          # tierflow and what it runs on
    python install.py --test   # and what its tests need
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# ggml's CMake switch for each x86 feature, with the /proc/cpuinfo flags it needs.
GGML_X86_FEATURES = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    # ggml's AVX512 switch compiles with -mavx512f/cd/vl/dq/bw together
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}


def cpu_flags() -> set[str]:
    """The instruction-set flags the kernel lists for this CPU."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def llama_cpp_cmake_args() -> str | None:
    """CMake arguments for a llama.cpp without AMX, or None where the native build is safe."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = cpu_flags()
    switches = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    for switch, needs in GGML_X86_FEATURES.items():
        switches.append(f"-D{switch}={'ON' if flags.issuperset(needs) else 'OFF'}")
    return " ".join(switches)


def llama_cpp_has_amx() -> bool:
    """Whether the installed llama.cpp was compiled with AMX tile instructions."""
    probe = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return done.returncode != 0 or "AMX_INT8 = 1" in done.stdout


def pip(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", *args], env=env, check=True)


def main() -> None:
    extras = "[test]" if "--test" in sys.argv[1:] else ""
    env = dict(os.environ)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    cmake_args = llama_cpp_cmake_args()
    if cmake_args:
        env["CMAKE_ARGS"] = f"{env.get('CMAKE_ARGS', '')} {cmake_args}".strip()
    pip("-e", f"{ROOT}{extras}", env=env)
    if cmake_args and llama_cpp_has_amx():
        print("install.py: the installed llama.cpp carries AMX; rebuilding it without", flush=True)
        pinned = f"llama-cpp-python=={version('llama-cpp-python')}"
        pip("--force-reinstall", "--no-deps", "--no-cache-dir", pinned, env=env)


if __name__ == "__main__":
    main()
