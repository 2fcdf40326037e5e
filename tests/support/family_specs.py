"""Each family's generator spec for the generic suite (tests/test_families.py): a small model with
F32 weights, shaped to reach what sets the family apart (a window shorter than the prompt, experts
with a shared one, leading dense layers, latent attention, recurrent layers). A new family adds
its line here; the suite then checks it against llama.cpp like every other."""

from tests.support.model_spec import ModelSpec

F32 = dict(weight_type="F32", embedding_type="F32", context_length=512)
DENSE = dict(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, **F32)
MOE = dict(DENSE, num_experts=4, experts_used=2, expert_ffn_size=64)
HYBRID = dict(num_layers=4, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, head_size=32,
              rope_dim=16, **F32)

FAMILY_SPECS: dict[str, ModelSpec] = {
    "llama": ModelSpec(arch="llama", **DENSE),
    "qwen2": ModelSpec(arch="qwen2", **DENSE),
    "qwen3": ModelSpec(arch="qwen3", **DENSE, head_size=24),
    "qwen2moe": ModelSpec(arch="qwen2moe", **MOE, shared_expert_ffn_size=96),
    "olmoe": ModelSpec(arch="olmoe", **(DENSE | dict(num_kv_heads=4, ffn_size=64)), num_experts=4,
                       experts_used=2),  # llama.cpp takes olmoe's expert width from ffn_size
    "qwen3moe": ModelSpec(arch="qwen3moe", **MOE),
    "gemma2": ModelSpec(arch="gemma2", **(DENSE | dict(num_layers=4)), head_size=32, sliding_window=16),
    "gemma3": ModelSpec(arch="gemma3", **(DENSE | dict(num_layers=6)), head_size=32, sliding_window=16),
    "glm4moe": ModelSpec(arch="glm4moe", **(MOE | dict(num_layers=3)), leading_dense_layers=1, nextn_layers=1,
                         rope_dim=8, qk_norm=True, tied_embeddings=False),
    "gpt-oss": ModelSpec(arch="gpt-oss", **(MOE | dict(num_layers=3)), head_size=64, sliding_window=16),
    "deepseek2": ModelSpec(arch="deepseek2", **(MOE | dict(num_layers=3)), head_size=48,
                           leading_dense_layers=1, kv_lora_rank=64, rope_dim=16, q_lora_rank=32),
    "qwen3next": ModelSpec(arch="qwen3next", **HYBRID, num_experts=4, experts_used=2, expert_ffn_size=64,
                           shared_expert_ffn_size=96),
    "qwen35": ModelSpec(arch="qwen35", **HYBRID),
    "qwen35moe": ModelSpec(arch="qwen35moe", **HYBRID, num_experts=4, experts_used=2, expert_ffn_size=64,
                           shared_expert_ffn_size=96),
}
