"""Maps the repository's top-level folders onto the one import package `tierflow`.

The package list is computed from the folders rather than written out: a nested subpackage
missing from a hand-written list imports in editable mode but silently drops out of the wheel.
"""

from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).parent
FOLDERS = {
    "tierflow": "core",
    "tierflow.runtime": "runtime",
    "tierflow.offload": "offload",
    "tierflow.speculative": "speculative",
    "tierflow.cpu_kernels": "cpu_kernels",
    "tierflow.gpu_kernels": "gpu_kernels",
    "tierflow.cli": "cli",
    "tierflow.server": "server",
}


def mapped_packages() -> dict[str, str]:
    """Every package (folder with an __init__.py) under each mapped folder, with its path."""
    packages = {}
    for package, folder in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder)
            name = ".".join((package, *relative.parts))
            packages[name] = init.parent.relative_to(ROOT).as_posix()
    return packages


# The CPU kernels: one portable build, with the AVX2 and AVX-512 paths compiled per function
# (target attributes) or per file (attend_*.c) and chosen at run time, so no -march flag ties the
# build to this machine.
KERNEL_SOURCES = ("module", "lut", "int8", "params", "ops", "pool", "crc32", "transcode",
                  "attend_avx512", "attend_avx2", "attend_portable")
KERNELS = Extension(
    "tierflow.cpu_kernels._kernels",
    sources=[f"cpu_kernels/csrc/{name}.c" for name in KERNEL_SOURCES],
    depends=[f"cpu_kernels/csrc/{name}.h"
             for name in ("kernels", "ops", "vec16", "attend", "sub_codes", "transcode")],
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-Wall", "-Wno-psabi"],
    extra_link_args=["-pthread"],
)

PACKAGES = mapped_packages()
setup(
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={"tierflow.server": ["*.html"]},
    ext_modules=[KERNELS],
)
