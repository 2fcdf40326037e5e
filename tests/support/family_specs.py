"""Each family as the generator knows it, one entry apiece: what llama.cpp requires of its files
beyond its tensors (FamilyTraits, which model_spec.py checks specs against and writes metadata by),
and the small spec with F32 weights that the generic suite runs against llama.cpp
(tests/test_families.py), shaped to reach what sets the family apart (a window shorter than the
prompt, experts with a shared one, leading dense layers, latent attention, recurrent layers,
state-space layers, each kind of layer a hybrid's pattern names, experts among dense FFNs).
A new family adds its entry here; the suite then checks it like every other.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTraits:
    """What llama.cpp requires of a family's file beyond its tensors (which the family's tensor
    map in tierflow.runtime.models gives)."""

    rope_freqs: bool = False        # llama.cpp accepts a rope_freqs.weight tensor for this arch
    experts: str = "never"          # "never", "optional" (num_experts 0: dense) or "always"
    no_gqa: bool = False            # llama.cpp's k norm is as wide as the q norm (olmoe)
    shared_expert: bool = False     # a sigmoid-gated shared expert beside the routed ones
    expert_width_key: bool = False  # experts are {arch}.expert_feed_forward_length wide, not
                                    # feed_forward_length (ffn_size) wide
    untied_only: bool = False       # llama.cpp requires output.weight
    tied_only: bool = False         # llama.cpp reads no output.weight (the head is token_embd)
    window_key: bool = False        # reads {arch}.attention.sliding_window and
                                    # {arch}.final_logit_softcapping
    attn_softcap_key: bool = False  # reads {arch}.attn_logit_softcapping
    leading_dense: bool = False     # reads {arch}.leading_dense_block_count
    nextn: bool = False             # reads {arch}.nextn_predict_layers (trailing blocks it skips)
    scored_router: bool = False     # sigmoid gating, exp_probs_b, weights normalised and scaled;
                                    # {arch}.expert_shared_count ungated shared experts
    optional_attention: bool = False  # q/k/v biases (written) and per-head q/k norms (on ask)
    required_window: int = 0        # llama.cpp requires {arch}.attention.sliding_window: this is
                                    # written when the spec sets none (0: not required)
    latent_attention: bool = False  # deepseek2's MLA: kv_lora_rank, rope_dim, value_head_size,
                                    # q_lora_rank and the router's keys (see ModelSpec)
    linear_attention: bool = False  # Gated DeltaNet layers (qwen3next, qwen35): the ssm.* keys and the
                                    # full-attention interval (see ModelSpec)
    rope_sections: bool = False     # interleaved multi-section rotary's rope.dimension_sections (qwen35)
    state_space: bool = False       # Mamba's layers only (mamba, mamba2): the ssm.* keys, no attention or
                                    # FFN keys (written as 0, as llama.cpp's converter writes them)
    time_step_projection: bool = False  # Mamba-1's low-rank time steps: ssm_value_heads is their rank
    layer_pattern: str = ""         # Mamba layers among others (granitehybrid, nemotron_h: Mamba-2; jamba:
                                    # Mamba-1): the layer kinds ModelSpec.layer_pattern may name ("M*":
                                    # Mamba, attention; "M*-": and FFN-only layers), written as
                                    # head_count_kv and feed_forward_length per layer beside the ssm.* keys
    interleaved_experts: bool = False  # experts in ModelSpec.expert_layers only, the other layers' FFN
                                       # dense (jamba): llama.cpp tells them by their router tensors
    layer_norm_eps_key: bool = False  # llama.cpp's build here requires {arch}.attention.layer_norm_epsilon
                                      # beside the RMS one (nemotron_h), and reads no more of it
    parallel_hybrid: bool = False   # attention and Mamba-2 in every layer (falcon-h1): the transformer's
                                    # keys and the ssm.* keys
    latent_experts: bool = False    # reads {arch}.moe_latent_size: experts in a latent width (nemotron_h_moe)
    granite_multipliers: bool = False  # reads embedding_scale, residual_scale, logit_scale,
                                       # attention.scale and rope.scaling.finetuned (see ModelSpec)


@dataclass(frozen=True)
class Family:
    traits: FamilyTraits
    spec: dict  # ModelSpec's keywords (but arch) for the generic suite


F32 = dict(weight_type="F32", embedding_type="F32", context_length=512)
DENSE = dict(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, **F32)
MOE = dict(DENSE, num_experts=4, experts_used=2, expert_ffn_size=64)
HYBRID = dict(num_layers=4, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, head_size=32,
              rope_dim=16, **F32)
# Mamba-1: time steps of rank 32 (a row length every weight type packs); Mamba-2: 8 heads of 16 in 2
# groups (llama.cpp asserts the inner size is a multiple of the groups times the hidden size)
MAMBA = dict(num_layers=2, hidden_size=64, ssm_inner_size=128, ssm_state=16, ssm_conv_kernel=4, **F32)
MAMBA2 = dict(MAMBA, ssm_value_heads=8, ssm_key_heads=2)
HYBRID_MOE = dict(HYBRID, num_experts=4, experts_used=2, expert_ffn_size=64, shared_expert_ffn_size=96)
# Mamba-2 among attention layers (llama.cpp's granitehybrid asserts an inner size of twice the hidden
# size): attention after a Mamba-2 layer and before two more
SSM_HYBRID = dict(MAMBA2, num_layers=4, ffn_size=128, num_heads=4, num_kv_heads=2, head_size=32,
                  layer_pattern="M*MM")
# Granite 4.0-H's multipliers (its files have no rotary), of sizes that keep the layers' outputs
# louder than the embeddings
GRANITE = dict(SSM_HYBRID, embedding_scale=1.5, residual_scale=0.5, logit_scale=2.0, attention_scale=0.125,
               rope=False)

# Jamba: Mamba-1 (time steps of rank 32, an inner size of twice the hidden size, as llama.cpp asserts)
# with attention (its heads together as wide as the hidden size, as llama.cpp requires) in one layer
# and experts in two, neither the first nor the last
JAMBA = dict(MAMBA, num_layers=4, ffn_size=128, num_heads=4, num_kv_heads=2, ssm_value_heads=32,
             layer_pattern="MM*M", num_experts=4, experts_used=2, expert_layers=(1, 2))

FAMILIES: dict[str, Family] = {
    "llama": Family(FamilyTraits(rope_freqs=True, experts="optional"), DENSE),
    "qwen2": Family(FamilyTraits(), DENSE),
    "qwen2moe": Family(FamilyTraits(experts="always", shared_expert=True, expert_width_key=True,
                                    untied_only=True), MOE | dict(shared_expert_ffn_size=96)),
    # llama.cpp takes olmoe's expert width from ffn_size
    "olmoe": Family(FamilyTraits(experts="always", no_gqa=True, untied_only=True),
                    DENSE | dict(num_kv_heads=4, ffn_size=64, num_experts=4, experts_used=2)),
    "qwen3": Family(FamilyTraits(), DENSE | dict(head_size=24)),
    "qwen3moe": Family(FamilyTraits(experts="always", expert_width_key=True), MOE),
    "gemma2": Family(FamilyTraits(tied_only=True, window_key=True, attn_softcap_key=True),
                     DENSE | dict(num_layers=4, head_size=32, sliding_window=16)),
    "gemma3": Family(FamilyTraits(window_key=True),
                     DENSE | dict(num_layers=6, head_size=32, sliding_window=16)),
    "glm4moe": Family(FamilyTraits(experts="always", expert_width_key=True, leading_dense=True, nextn=True,
                                   scored_router=True, optional_attention=True),
                      MOE | dict(num_layers=3, leading_dense_layers=1, nextn_layers=1, rope_dim=8,
                                 qk_norm=True, tied_embeddings=False)),
    "gpt-oss": Family(FamilyTraits(experts="always", expert_width_key=True, untied_only=True,
                                   required_window=128),
                      MOE | dict(num_layers=3, head_size=64, sliding_window=16)),
    "deepseek2": Family(FamilyTraits(experts="always", expert_width_key=True, leading_dense=True,
                                     latent_attention=True),
                        MOE | dict(num_layers=3, head_size=48, leading_dense_layers=1, kv_lora_rank=64,
                                   rope_dim=16, q_lora_rank=32)),
    "qwen3next": Family(FamilyTraits(experts="always", expert_width_key=True, shared_expert=True,
                                     linear_attention=True, nextn=True), HYBRID_MOE),
    "qwen35": Family(FamilyTraits(linear_attention=True, rope_sections=True, nextn=True), HYBRID),
    "qwen35moe": Family(FamilyTraits(experts="always", expert_width_key=True, shared_expert=True,
                                     linear_attention=True, rope_sections=True, nextn=True), HYBRID_MOE),
    "mamba": Family(FamilyTraits(state_space=True, time_step_projection=True),
                    MAMBA | dict(ssm_value_heads=32)),
    "mamba2": Family(FamilyTraits(state_space=True), MAMBA2),
    "granitehybrid": Family(FamilyTraits(experts="optional", shared_expert=True, layer_pattern="M*",
                                         granite_multipliers=True), GRANITE),
    "nemotron_h": Family(FamilyTraits(layer_pattern="M*-", layer_norm_eps_key=True),
                         SSM_HYBRID | dict(num_layers=6, layer_pattern="M-*M-M")),
    "nemotron_h_moe": Family(
        FamilyTraits(experts="always", expert_width_key=True, shared_expert=True, scored_router=True,
                     layer_pattern="M*-", layer_norm_eps_key=True, latent_experts=True),
        SSM_HYBRID | dict(num_layers=6, layer_pattern="M-*M-M", num_experts=4, experts_used=2,
                          expert_ffn_size=64, shared_expert_ffn_size=96)),
    "falcon-h1": Family(FamilyTraits(parallel_hybrid=True), SSM_HYBRID | dict(layer_pattern=None)),
    "jamba": Family(FamilyTraits(experts="always", time_step_projection=True, layer_pattern="M*",
                                 interleaved_experts=True), JAMBA),
}
