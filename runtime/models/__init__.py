"""One file per model family: the only place an architecture is named.

Each family's file builds an `Architecture` (architecture.py): how its GGUF metadata becomes a
ModelConfig, its tensor map (tensor_map.py) and its block (from the shared parts in layers.py).
Adding a family is one new file here and one line below; see the README's "Adding an
architecture".

Beside the families: config.py (ModelConfig and the typed metadata reads; each layer's kind of
memory, runtime/memory/kinds.py), layers.py (the blocks' shared parts), latent_attention.py and
delta_net.py (the attention kinds more than one family uses), state_space.py (what Mamba's families
share), ssm_hybrid.py (what the hybrids of Mamba layers among attention layers share).
"""

from tierflow.errors import UnsupportedModelError
from tierflow.runtime.models import (
    deepseek2,
    falcon_h1,
    gemma2,
    gemma3,
    glm4moe,
    gptoss,
    granitehybrid,
    jamba,
    llama,
    mamba,
    mamba2,
    nemotron_h,
    olmoe,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen3next,
    qwen35,
    qwen35moe,
)
from tierflow.runtime.models.architecture import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (*(family.ARCHITECTURE for family in (
        llama, qwen2, qwen2moe, olmoe, qwen3, qwen3moe, gemma2, gemma3, glm4moe, gptoss, deepseek2, qwen3next,
        qwen35, qwen35moe, mamba, mamba2, granitehybrid, nemotron_h, falcon_h1, jamba)),
        nemotron_h.MOE_ARCHITECTURE)
}


def architecture(name: object) -> Architecture:
    """The family a file's `general.architecture` names; an unknown one is an
    UnsupportedModelError listing those tierflow runs."""
    found = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnsupportedModelError(f"architecture {name!r} is not supported "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
    return found
