"""What make_model generates: the spec, and the tensors and architecture metadata it stands for.

Pure layout, no I/O: the vocabulary size comes in as an argument (make_model takes it, with the
tokenizer, from the bundled SmolLM2 file).

Mixture-of-experts layers, as llama.cpp computes them (src/models/llama.cpp, qwen2moe.cpp,
olmoe.cpp; llm_graph_context::build_moe_ffn in src/llama-graph.cpp). T tokens, E experts, k used;
x [T, hidden] is the ffn_norm output (RMSNorm, eps layer_norm_rms_epsilon, times ffn_norm.weight):
    p = softmax(x @ ffn_gate_inp.T)                  # [T, E], F32, softmax over all E experts
    chosen = top-k of p per token                    # [T, k]
    w = p[chosen]                                    # [T, k]; llama: w / w.sum(-1) (norm_w)
    out = sum_j w_j * down_e(silu(gate_e x) * up_e x) for e = chosen_j   # SwiGLU per expert
llama (Mixtral): norm_w true; rope NORM (adjacent pairs); experts are feed_forward_length wide.
qwen2moe: norm_w false (raw softmax weights, summing to < 1); q/k/v biases; rope NEOX (halves);
    experts are expert_feed_forward_length wide, and a shared expert is added to the routed sum:
    sigmoid(x @ ffn_gate_inp_shexp) * down_s(silu(gate_s x) * up_s x), its width
    expert_shared_feed_forward_length (ffn_gate_inp_shexp is 1-D, [hidden]).
olmoe: norm_w false; rope NEOX; no biases; q = RMSNorm(x @ Wq) * attn_q_norm and
    k = RMSNorm(x @ Wk) * attn_k_norm over the whole projection (all heads at once, eps
    layer_norm_rms_epsilon), before the split into heads and before rope; experts are
    feed_forward_length wide.
No {arch}.expert_weights_scale is written, so llama.cpp scales no weights. llama.cpp requires
output.weight for qwen2moe and olmoe, and an olmoe k norm as wide as the q norm (no GQA).
glm4moe (src/models/glm4-moe.cpp): the first leading_dense_block_count layers have a dense FFN
(feed_forward_length); the others p = sigmoid(x @ ffn_gate_inp.T), chosen = top-k of
p + exp_probs_b, w = p[chosen] / sum (expert_weights_norm) * expert_weights_scale, plus
expert_shared_count shared experts' width of one expert (ungated); its pre-FFN norm is
post_attention_norm; optional q/k/v biases and per-head q/k norms; neox rope over
rope.dimension_count dimensions of each head. The trailing nextn_predict_layers blocks (counted
in block_count) hold every tensor of a MoE layer plus nextn.eh_proj, enorm and hnorm, which
llama.cpp requires and skips.
qwen35, qwen35moe and qwen3next with nextn_layers=1 (llama.cpp's single MTP block) write the
block as their family's mtp_fields name it: a full-attention layer with the family's FFN and the
nextn tensors; llama.cpp runs it as graph_mtp in an MTP context (load_mtp).

gemma2 and gemma3 (src/models/gemma2*.cpp, gemma3*.cpp): x = token_embd[ids] * sqrtf(hidden);
per layer h = attn_post_norm(attention(attn_norm(x))) + x, then x = ffn_post_norm(ffn(ffn_norm(h)))
+ h, the FFN down(gelu_tanh(gate h) * up h); neox rope; queries scaled by 1/sqrt(head_dim) (no key
sets it); sliding windows on layers i % 2 < 1 (gemma2) or i % 6 < 5 (gemma3) of
attention.sliding_window positions (gemma2 default 4096; gemma3 none without the key), gemma3's
local layers rotating with base 10000; gemma3 per-head q/k norms; gemma2 caps attention scores and
logits, cap * tanh(x / cap), at attn_logit_softcapping (default 50) and final_logit_softcapping
(default 30), gemma3 logits only where that key is written. gemma2 reads no output.weight.

gpt-oss (src/models/openai-moe-iswa.cpp): biases on q/k/v, attn_output, ffn_gate_inp and each
expert's gate/up/down (stacked [width, experts]); one sink logit per query head (attn_sinks, [heads])
in each head's softmax; neox rope; attention.sliding_window (required) on layers i % 2 == 0;
post_attention_norm is the FFN's input norm; routing: top-k of the router's logits, then softmax
over those k; each expert min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1) before down.
llama.cpp requires output.weight and expert_feed_forward_length.

Weight mixes: "Q4_K_M" types each tensor as llama.cpp's llama-quant.cpp does for a dense model
(Q6_K for the output head, and attn_v and ffn_down on its "more bits" layers; Q4_K otherwise)
and falls back, as it does, where a row is not a multiple of 256: Q4_K to Q5_0, Q6_K to Q8_0
(Gemma 3 1B's hidden size of 1152 makes real files mix all four).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from tests.support.family_specs import FAMILIES, FamilyTraits
from tests.support.gguf_bytes import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, Typed
from tests.support.gguf_writing import TensorEntry
from tierflow.runtime.models import architecture
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.config import ModelConfig
from tierflow.runtime.models.tensor_map import Field, Tensor, Vector

Q = GGMLQuantizationType
FILE_TYPES = {  # weight type name -> general.file_type
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K, "Q2_K": LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": LlamaFileType.MOSTLY_Q3_K_S, "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL,
    "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS, "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
    "TQ1_0": LlamaFileType.MOSTLY_TQ1_0, "TQ2_0": LlamaFileType.MOSTLY_TQ2_0,
}


MAX_EXPERTS = 512  # llama.cpp's LLAMA_MAX_EXPERTS: past it, loading aborts the process


ARCHS: dict[str, FamilyTraits] = {name: family.traits for name, family in FAMILIES.items()}
MIXES = {"Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M}  # weight types that type each tensor by its role
_MIX_BLOCK = 32  # every type a mix falls back to packs rows in blocks of 32


@dataclass(frozen=True)
class ModelSpec:
    """What to generate. Validated so that every spec gives a file llama.cpp loads."""

    arch: str = "llama"              # a key of ARCHS
    num_layers: int = 2
    hidden_size: int = 64
    ffn_size: int = 128              # feed_forward_length: the dense FFN, or (llama, olmoe) each
                                     # expert's width
    num_experts: int = 0             # routed experts per layer; 0: a dense FFN (llama only)
    experts_used: int = 2            # experts each token is routed to (top-k); MoE only
    expert_ffn_size: int | None = None         # each expert's width (qwen2moe); None: ffn_size
    shared_expert_ffn_size: int | None = None  # the shared expert's width (qwen2moe); None:
                                               # ffn_size, as llama.cpp assumes without the key
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int | None = None     # attention.key_length, each head's size; None: hidden / heads
    context_length: int = 256
    rope_theta: float = 10000.0
    rope_scaling: str | None = None  # None, "linear" or "yarn" (writes {arch}.rope.scaling.*)
    rope_scaling_factor: float = 1.0
    llama3_rope_freqs: bool = False  # add rope_freqs.weight with llama3-style factors (llama)
    tied_embeddings: bool | None = None  # no output.weight: llama.cpp reuses token_embd; None:
                                         # tied where the arch allows it (not qwen2moe, olmoe)
    sliding_window: int | None = None  # attention.sliding_window (gemma2, gemma3); None: not
                                       # written (gemma2: 4096 then, gemma3: no window)
    attn_logit_softcap: float | None = None   # gemma2's attn_logit_softcapping; None: not written
    final_logit_softcap: float | None = None  # final_logit_softcapping (gemma2, gemma3)
    leading_dense_layers: int = 0    # leading_dense archs: the first layers' FFN is dense, ffn_size wide
    nextn_layers: int = 0            # nextn archs: next-token-prediction blocks after the others
    shared_experts: int = 1          # scored_router archs: expert_shared_count
    rope_dim: int | None = None      # rope.dimension_count, even, <= head_dim; None: head_dim
    qk_norm: bool = False            # optional_attention archs: write per-head q/k norms
    # deepseek2 (latent attention): head_size is each head's query/key size (key_length_mla), of
    # which rope_dim (required) rotate; keys and values are compressed to kv_lora_rank; each head's value is
    # value_head_size wide; queries go through a rank of q_lora_rank (0: one attn_q, as the Lite
    # models). Experts: expert_gating "softmax" or "sigmoid" (sigmoid files carry the selection
    # bias exp_probs_b, as V3's), weights renormalised and then scaled, shared_experts of
    # expert_ffn_size each.
    kv_lora_rank: int = 64
    value_head_size: int = 32
    q_lora_rank: int = 0
    expert_gating: str = "softmax"
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    expert_groups: int = 1           # expert_group_count (V3's n_group); 1: not written
    # Gated DeltaNet (linear_attention archs): every full_attention_interval-th layer is full
    # attention, the others linear, with ssm_key_heads query/key heads and ssm_value_heads value
    # heads of ssm_state each, and a causal convolution of ssm_conv_kernel taps.
    # Mamba (state_space archs): ssm_inner_size channels, a state of ssm_state per channel or head;
    # Mamba-2's ssm_value_heads heads and ssm_key_heads groups of B and C (the same keys:
    # time_step_rank, group_count), Mamba-1's time steps of rank ssm_value_heads.
    full_attention_interval: int = 4
    ssm_state: int = 16
    ssm_key_heads: int = 2
    ssm_value_heads: int = 4
    ssm_conv_kernel: int = 4
    ssm_inner_size: int | None = None  # ssm.inner_size; None: ssm_value_heads * ssm_state (DeltaNet's)
    ssm_dt_b_c_rms: bool = False     # Falcon-Mamba's ssm.dt_b_c_rms (mamba): dt, B and C RMS-normed
    moe_latent_size: int = 0         # latent_experts archs: the experts' latent width (0: the hidden size)
    expert_groups_used: int = 1      # expert_group_used_count (V3's topk_group)
    # Hybrids (layer_pattern archs): each layer's kind, one character per layer as Nemotron-H's
    # hybrid_override_pattern writes it: "M" Mamba-2 (ssm_* sizes as mamba2's), "*" attention, "-" an
    # FFN alone (nemotron_h); written as head_count_kv and feed_forward_length per layer.
    layer_pattern: str | None = None
    # interleaved_experts archs (jamba): the layers whose FFN is experts, with a router llama.cpp tells
    # them by; the other layers' FFN is dense, ffn_size wide as the experts are
    expert_layers: tuple[int, ...] = ()
    # Granite's multipliers (granite_multipliers archs), each written where set: the embeddings',
    # each block output's, the logits' divisor and the attention scores'; rope False writes
    # rope.scaling.finetuned false (Granite 4.0-H's files: attention without rotary).
    embedding_scale: float | None = None
    residual_scale: float | None = None
    logit_scale: float | None = None
    attention_scale: float | None = None
    rope: bool = True
    yarn_log_multiplier: float | None = None  # rope.scaling.yarn_log_multiplier (0.1 x DeepSeek's
                                              # mscale_all_dim, as the converter writes it)
    weight_type: str = "Q8_0"        # every 2-D matrix and expert stack, output.weight included:
                                     # a type, or a mix (MIXES) that types each by its role
    embedding_type: str = "Q8_0"     # token_embd.weight (a mix: typed as the mix types it)
    expert_type: str | None = None   # the routed experts' stacked tensors (gpt-oss: MXFP4);
                                     # None: weight_type
    pooling_type: int | None = None  # {arch}.pooling_type, llama.cpp's enum (0 none, 1 mean, 2 cls,
                                     # 3 last, 4 rank); None: not written
    vocab_size: int | None = None    # the embedding's (and head's) rows; None: the tokenizer's tokens.
                                     # More rows than tokens, as real files pad theirs (Qwen2.5:
                                     # 151936 rows); fewer cannot hold the tokenizer (make_model says so)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, not {self.arch!r}")
        if self.tied_embeddings is None:  # resolved here, so the field always reads as a bool
            object.__setattr__(self, "tied_embeddings", not ARCHS[self.arch].untied_only)
        self._check_gemma_keys()
        for name in ("num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads",
                     "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_size is None and self.hidden_size % self.num_heads or self.head_dim % 2 \
                or self.head_dim < 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.num_heads} "
                             "heads of even size, or head_size be even")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        self._check_experts()
        self._check_layers()
        self._check_pattern()
        self._check_arch()
        self._check_latent()
        self._check_rope()
        for field, row_lengths in (("weight_type", self._row_lengths()),
                                   ("embedding_type", (self.hidden_size,))):
            self._check_type(field, row_lengths)
        if self.expert_type is not None:
            if not self.num_experts:
                raise ValueError("expert_type needs num_experts")
            self._check_type("expert_type", (self.hidden_size, self.expert_ffn_width))

    def _check_arch(self) -> None:
        traits = ARCHS[self.arch]
        if traits.untied_only and self.tied_embeddings:
            raise ValueError(f"llama.cpp requires output.weight for arch {self.arch!r}: "
                             "tied_embeddings must be False")
        if traits.no_gqa and self.num_kv_heads != self.num_heads:
            raise ValueError(f"llama.cpp's {self.arch!r} k norm is hidden_size wide: num_kv_heads "
                             f"{self.num_kv_heads} must equal num_heads {self.num_heads}")

    def _check_latent(self) -> None:
        if not ARCHS[self.arch].latent_attention:
            return
        if self.rope_dim is None or self.rope_dim >= self.head_dim:
            raise ValueError(f"latent attention rotates part of each head: rope_dim must be below head_size "
                             f"{self.head_dim}, got {self.rope_dim}")
        for name in ("kv_lora_rank", "value_head_size", "shared_experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.expert_gating not in ("softmax", "sigmoid"):
            raise ValueError(f"expert_gating must be 'softmax' or 'sigmoid', not {self.expert_gating!r}")

    def _check_layers(self) -> None:
        """The glm4moe-style knobs: only where the arch reads them, and in range."""
        traits = ARCHS[self.arch]
        shared = traits.scored_router or traits.latent_attention
        knobs = {"leading_dense_layers": (self.leading_dense_layers != 0, traits.leading_dense),
                 "nextn_layers": (self.nextn_layers != 0, traits.nextn),
                 "shared_experts": (self.shared_experts != 1, shared),
                 "qk_norm": (self.qk_norm, traits.optional_attention),
                 "moe_latent_size": (self.moe_latent_size != 0, traits.latent_experts)}
        for name, (given, read) in knobs.items():
            if given and not read:
                raise ValueError(f"llama.cpp reads no {name} for arch {self.arch!r}")
        if not 0 <= self.leading_dense_layers < self.num_layers:
            raise ValueError(f"leading_dense_layers must be 0..{self.num_layers - 1} (a MoE layer "
                             f"must be left), got {self.leading_dense_layers}")
        if self.nextn_layers < 0 or self.shared_experts < 0:
            raise ValueError("nextn_layers and shared_experts must be >= 0")
        if self.rope_dim is not None and not (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise ValueError(f"rope_dim must be even and within head size {self.head_dim}, "
                             f"got {self.rope_dim}")

    def _check_pattern(self) -> None:
        """A hybrid's pattern: one kind its arch defines per layer; Granite's keys only where read."""
        traits = ARCHS[self.arch]
        if (self.layer_pattern is None) != (not traits.layer_pattern):
            raise ValueError(f"layer_pattern is for the hybrid archs, and they need one: arch {self.arch!r}")
        if self.layer_pattern is not None and (len(self.layer_pattern) != self.num_layers
                                               or set(self.layer_pattern) - set(traits.layer_pattern)):
            raise ValueError(f"layer_pattern must be one of {traits.layer_pattern!r} per layer "
                             f"({self.num_layers}), got {self.layer_pattern!r}")
        if bool(self.expert_layers) != traits.interleaved_experts or not all(
                0 <= layer < self.num_layers for layer in self.expert_layers):
            raise ValueError(f"expert_layers is for the archs with experts among dense FFNs, which need "
                             f"one or more of layers 0..{self.num_layers - 1}: arch {self.arch!r}, got "
                             f"{self.expert_layers}")
        granite = (self.embedding_scale, self.residual_scale, self.logit_scale, self.attention_scale)
        if (any(v is not None for v in granite) or not self.rope) and not traits.granite_multipliers:
            raise ValueError(f"llama.cpp reads no Granite multipliers for arch {self.arch!r}")

    def _check_gemma_keys(self) -> None:
        traits = ARCHS[self.arch]
        if traits.tied_only and not self.tied_embeddings:
            raise ValueError(f"llama.cpp reads no output.weight for arch {self.arch!r}: "
                             "tied_embeddings must be True")
        given = {"sliding_window": traits.window_key or bool(traits.required_window),
                 "final_logit_softcap": traits.window_key,
                 "attn_logit_softcap": traits.attn_softcap_key}
        for name, read in given.items():
            if getattr(self, name) is not None and not read:
                raise ValueError(f"llama.cpp reads no {name} for arch {self.arch!r}")
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def _check_experts(self) -> None:
        traits = ARCHS[self.arch]
        if self.num_experts == 0:
            if traits.experts == "always":
                raise ValueError(f"arch {self.arch!r} is mixture-of-experts: num_experts must "
                                 "be at least 2")
            if self.expert_ffn_size is not None or self.shared_expert_ffn_size is not None:
                raise ValueError("expert_ffn_size and shared_expert_ffn_size need num_experts")
            return
        if traits.experts == "never":
            raise ValueError(f"llama.cpp's {self.arch!r} has no experts: num_experts must be 0")
        if not 2 <= self.num_experts <= MAX_EXPERTS:
            dense = " (or 0: dense)" if traits.experts == "optional" else ""
            raise ValueError(f"num_experts must be between 2 and {MAX_EXPERTS}{dense}, got "
                             f"{self.num_experts}")
        if not 1 <= self.experts_used <= self.num_experts:
            raise ValueError(f"experts_used must be between 1 and num_experts "
                             f"{self.num_experts}, got {self.experts_used}")
        for name in ("expert_ffn_size", "shared_expert_ffn_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not traits.expert_width_key and self.expert_ffn_width != self.ffn_size:
            raise ValueError(f"llama.cpp's {self.arch!r} takes the expert width from "
                             f"feed_forward_length: set ffn_size, not expert_ffn_size")
        if not traits.shared_expert and self.shared_expert_ffn_size is not None:
            raise ValueError(f"arch {self.arch!r} has no shared expert")

    def _check_rope(self) -> None:
        if self.rope_scaling not in (None, "linear", "yarn"):
            raise ValueError(f"rope_scaling must be None, 'linear' or 'yarn', not "
                             f"{self.rope_scaling!r}")
        if self.rope_scaling is None and self.rope_scaling_factor != 1.0:
            raise ValueError("rope_scaling_factor needs rope_scaling set")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"rope_scaling_factor must be positive, got "
                             f"{self.rope_scaling_factor}")
        if self.llama3_rope_freqs and not ARCHS[self.arch].rope_freqs:
            raise ValueError(f"llama.cpp reads no rope_freqs tensor for arch {self.arch!r}")
        if self.pooling_type is not None and not 0 <= self.pooling_type <= 4:
            raise ValueError(f"pooling_type must be one of llama.cpp's 0..4, got {self.pooling_type}")

    def _row_lengths(self) -> tuple[int, ...]:
        """Every weight_type row length: matrices' inputs, the FFN's and experts' down rows."""
        if ARCHS[self.arch].state_space:
            rank = (self.ssm_value_heads,) if ARCHS[self.arch].time_step_projection else ()
            return (self.hidden_size, self.ssm_inner) + rank
        if ARCHS[self.arch].layer_pattern or ARCHS[self.arch].parallel_hybrid:
            ffn = ((self.expert_ffn_width, self.shared_expert_ffn_width) if self.num_experts
                   else (self.ffn_size,)) + ((self.moe_latent_size,) if self.moe_latent_size else ())
            rank = (self.ssm_value_heads,) if ARCHS[self.arch].time_step_projection else ()
            return (self.hidden_size, self.ssm_inner, self.num_heads * self.head_dim) + ffn + rank
        if ARCHS[self.arch].linear_attention:
            values = self.ssm_value_heads * self.ssm_state
            lengths = (self.hidden_size, self.num_heads * self.head_dim, values)
            if self.num_experts:
                lengths += (self.expert_ffn_width, self.shared_expert_ffn_width)
            return lengths + ((self.ffn_size,) if not self.num_experts else ())
        if ARCHS[self.arch].latent_attention:
            lengths = (self.hidden_size, self.ffn_size, self.expert_ffn_width, self.kv_lora_rank,
                       self.num_heads * self.value_head_size, self.head_dim - self.rope_dim,
                       self.expert_ffn_width * self.shared_experts)
            return lengths + ((self.q_lora_rank,) if self.q_lora_rank else ())
        lengths = (self.hidden_size, self.ffn_size, self.num_heads * self.head_dim)
        if self.num_experts:
            lengths += (self.expert_ffn_width,)
        if self.num_experts and ARCHS[self.arch].shared_expert:
            lengths += (self.shared_expert_ffn_width,)
        if self.num_experts and ARCHS[self.arch].scored_router and self.shared_experts:
            lengths += (self.shared_experts * self.expert_ffn_width,)
        return lengths

    def _check_type(self, field: str, row_lengths: tuple[int, ...]) -> None:
        name = getattr(self, field)
        if name not in FILE_TYPES and name not in MIXES:
            raise ValueError(f"{field} must be one of {sorted(FILE_TYPES | MIXES)}, not {name!r}")
        block_size = _MIX_BLOCK if name in MIXES else GGML_QUANT_SIZES[Q[name]][0]
        if any(length % block_size for length in row_lengths):
            raise ValueError(f"{field} {name} packs rows in blocks of {block_size}: row lengths "
                             f"{row_lengths} do not divide")

    @property
    def ssm_inner(self) -> int:
        return self.ssm_value_heads * self.ssm_state if self.ssm_inner_size is None else self.ssm_inner_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads if self.head_size is None else self.head_size

    @property
    def kv_size(self) -> int:
        """Width of the K and V projections (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def expert_ffn_width(self) -> int:
        return self.ffn_size if self.expert_ffn_size is None else self.expert_ffn_size

    @property
    def shared_expert_ffn_width(self) -> int:
        return self.ffn_size if self.shared_expert_ffn_size is None else self.shared_expert_ffn_size


# Matrices get std gain/sqrt(fan_in), so that with unit-RMS inputs their outputs have std ~gain.
# token_embd/output: logits std ~_LOGIT_GAIN, tied or not, so the top logits stand apart.
# attn_output/ffn_down write into the residual stream _RESIDUAL_GAIN times louder, so that by the
# final norm a token's own embedding is a small part of the stream: with tied embeddings its
# logit would otherwise win by ~sqrt(hidden) standard deviations, every argmax would echo the
# input token, and an oracle comparing argmaxes would pass even with broken layers.
_LOGIT_GAIN = 8.0
_RESIDUAL_GAIN = 3.0
_NORM_STD = 0.1       # norm weights are 1 + N(0, _NORM_STD)
_BIAS_STD = 0.5       # large enough that a dropped q/k/v bias changes the argmax
# MoE layers. Router logits get std ~_ROUTER_GAIN, so the k-th chosen expert's softmax weight
# is typically ~0.2: it counts, yet the top one leads. No gain widens the k-th/(k+1)-th margins
# against perturbed hidden states (both scale with it). Attention averages over the context, so
# its output is largely shared by a sequence's tokens (and Wo @ bv by all tokens): written at
# _RESIDUAL_GAIN it takes over the router input a few layers deep (70% of its energy common to
# the tokens by layer 8, one expert picked by every token), so MoE attention writes at gain 1
# (5-15% common at any depth, every expert used) and qwen2moe's v bias is smaller. The routed
# output mixes k experts with weights summing to at most 1, so experts write at _EXPERT_GAIN:
# at _RESIDUAL_GAIN a tied llama MoE's argmax would echo the input token for ~22% of tokens.
_ROUTER_GAIN = 2.0
_EXPERT_GAIN = 5.0
_SHARED_GATE_GAIN = 1.0  # qwen2moe's shared-expert gate: sigmoid mostly within 0.2..0.8
_MOE_ATTN_GAIN = 1.0
_MOE_V_BIAS_STD = 0.2
# glm4moe: sigmoid scores of router logits at _ROUTER_GAIN spread over most of (0, 1); a selection
# bias of this spread reorders close experts (a dropped or misapplied bias changes the choice)
# without deciding every choice. The weights, normalised, are scaled by _EXPERT_WEIGHTS_SCALE.
_SELECTION_BIAS_STD = 0.2
_EXPERT_WEIGHTS_SCALE = 1.5
# Gemma scales the embeddings by sqrt(hidden), so its stream starts at RMS ~_LOGIT_GAIN, and
# normalises each layer's outputs (post norms) before they join it: post norms of this mean make
# the layers write as much louder than the embeddings as a Llama block's _RESIDUAL_GAIN does.
_POST_NORM_MEAN = _RESIDUAL_GAIN * _LOGIT_GAIN
_POST_NORMS = {"post_attention_norm.weight", "post_ffw_norm.weight"}
_SANDWICH_ARCHS = {"gemma2", "gemma3"}  # glm4moe's post_attention_norm is its pre-FFN norm
# gpt-oss: sinks of the spread of the attention scores (~1), so they take a share that counts;
# experts' gate and up projections spread ~3, so that some of their outputs pass the clamped
# SwiGLU's limit of 7 (only there do min(gate, 7) and clamp(up, -7, 7) change anything).
_SINK_STD = 1.0
_ARCH_GAINS = {"gpt-oss": {"ffn_gate_exps.weight": 3.0, "ffn_up_exps.weight": 3.0}}


def _decays(shape: tuple[int, ...], spec: ModelSpec) -> np.ndarray:
    """ssm_a, -exp(A_log): a decay per value head of about 0.2 (times softplus of ~1), so the state
    keeps most of what it held a few tokens back and a wrong state shows in the logits."""
    rng = np.random.default_rng(spec.seed + 7)
    return (-np.exp(rng.normal(np.log(0.2), 0.5, shape))).astype(np.float32)


def _uniform(low: float, high: float, salt: int):
    def values(shape: tuple[int, ...], spec: ModelSpec) -> np.ndarray:
        return np.random.default_rng(spec.seed + salt).uniform(low, high, shape).astype(np.float32)
    return values


# Recurrent layers' tensors with values of their own, in float32 as llama.cpp's converter keeps them:
# the decays, their bias, and a causal convolution whose taps sum to about 1 per channel (Mamba's
# with a bias).
_RECURRENT_VALUES = {"ssm_a": _decays, "ssm_dt.bias": _uniform(-0.5, 0.5, 11),
                     "ssm_conv1d.weight": _uniform(-0.2, 0.7, 13), "ssm_conv1d.bias": _uniform(-0.3, 0.3, 17)}


class PlannedTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order, ([experts,] rows, row_length); GGUF lists it reversed
    qtype: GGMLQuantizationType
    std: float
    mean: float = 0.0
    values: np.ndarray | None = None  # fixed contents instead of random ones

    @property
    def entry(self) -> TensorEntry:
        return TensorEntry(self.name, self.shape[::-1], self.qtype)


def _role(name: str) -> str:
    """A tensor's name without its layer: "blk.3.attn_q.weight" -> "attn_q.weight"."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def _gain(role: str, moe: bool, arch: str) -> float:
    """What a matrix's outputs' spread is, for unit-RMS inputs (see the constants above)."""
    if role in _ARCH_GAINS.get(arch, {}):
        return _ARCH_GAINS[arch][role]
    gains = {"token_embd.weight": _LOGIT_GAIN, "output.weight": _LOGIT_GAIN,
             "attn_output.weight": _MOE_ATTN_GAIN if moe else _RESIDUAL_GAIN,
             "ssm_out.weight": _MOE_ATTN_GAIN if moe else _RESIDUAL_GAIN,
             "ffn_down.weight": _RESIDUAL_GAIN, "ffn_down_shexp.weight": _RESIDUAL_GAIN,
             "ffn_down_exps.weight": _EXPERT_GAIN, "ffn_gate_inp.weight": _ROUTER_GAIN,
             "ffn_gate_inp_shexp.weight": _SHARED_GATE_GAIN}
    return gains.get(role, 1.0)


def _planned(tensor: Tensor, spec: ModelSpec, bias: bool = False, vector: bool = False) -> PlannedTensor:
    """A tensor of the family's map with random contents of the spread its role calls for (`vector`:
    a Vector field's, float32 as it is used)."""
    shape, role, moe = tensor.shape[::-1], _role(tensor.name), spec.num_experts > 0
    if role == "exp_probs_b.bias":
        return PlannedTensor(tensor.name, shape, Q.F32, _SELECTION_BIAS_STD)
    if bias:
        std = _MOE_V_BIAS_STD if moe and role == "attn_v.bias" else _BIAS_STD
        return PlannedTensor(tensor.name, shape, Q.F32, std)
    if role == "attn_sinks.weight":
        return PlannedTensor(tensor.name, shape, Q.F32, _SINK_STD)
    if role in _RECURRENT_VALUES:
        return PlannedTensor(tensor.name, shape, Q.F32, 0.0, values=_RECURRENT_VALUES[role](shape, spec))
    if vector:  # a norm's weight, or one used as one (Mamba's D)
        mean = _POST_NORM_MEAN if role in _POST_NORMS and spec.arch in _SANDWICH_ARCHS else 1.0
        return PlannedTensor(tensor.name, shape, Q.F32, _NORM_STD * mean, mean=mean)
    qtype = Q.F32 if role.startswith("ffn_gate_inp") else _weight_type(tensor, spec)
    return PlannedTensor(tensor.name, shape, qtype, _gain(role, moe, spec.arch) / math.sqrt(tensor.shape[0]))


def _weight_type(tensor: Tensor, spec: ModelSpec) -> GGMLQuantizationType:
    """A matrix's type: the spec's, or what its mix gives the tensor's role and layer."""
    role = _role(tensor.name)
    name = spec.embedding_type if role == "token_embd.weight" else spec.weight_type
    if spec.expert_type is not None and role.endswith("_exps.weight"):
        name = spec.expert_type
    if name not in MIXES:
        return Q[name]
    head = role == "output.weight" or role == "token_embd.weight" and spec.tied_embeddings
    layer = int(tensor.name.split(".")[1]) if tensor.name.startswith("blk.") else 0
    more_bits = role in ("attn_v.weight", "ffn_down.weight") and _use_more_bits(layer, spec.num_layers)
    qtype = Q.Q6_K if head or more_bits else Q.Q4_K
    if tensor.shape[0] % 256:  # llama-quant.cpp's fallback for rows K-quants cannot pack
        qtype = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[qtype]
    return qtype


def _use_more_bits(layer: int, num_layers: int) -> bool:
    """llama-quant.cpp's layers that Q4_K_M gives Q6_K attn_v and ffn_down: the first and last
    eighth, and every third in between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def _field_plan(field: Field, spec: ModelSpec) -> list[PlannedTensor]:
    """A field's tensors (each weight followed by its bias); a stacked expert tensor once, whole."""
    kind = field.kind
    if isinstance(kind, Vector):
        return [_planned(kind.tensor, spec, vector=True)]
    plan = []
    for weight in kind.weights:
        plan.append(_planned(replace(weight, expert=None), spec))
        if kind.bias == "required" or kind.bias == "optional" and ARCHS[spec.arch].optional_attention:
            plan.append(_planned(kind.bias_tensor(weight), spec, bias=True))
    return plan


def family_spec(name: str) -> ModelSpec:
    """The family's spec for the generic suite (family_specs.py), as a ModelSpec."""
    return ModelSpec(arch=name, **FAMILIES[name].spec)


def spec_config(spec: ModelSpec, vocab_size: int) -> ModelConfig:
    """The config tierflow reads from the metadata make_model writes for `spec` (and, where the family
    tells its MoE layers by their routers, from the routers it writes)."""
    metadata = {key: typed.value for key, typed in architecture_metadata(spec, vocab_size)}
    routers = {f"blk.{layer}.ffn_gate_inp.weight" for layer in spec.expert_layers}
    return architecture(spec.arch).read_config(metadata, vocab_size, spec.tied_embeddings, routers)


def _llama3_rope_factors(spec: ModelSpec) -> np.ndarray:
    """Llama 3.1's per-frequency divisors (factor 8, low 1, high 4), with the spec's context as
    the original one so that small test models get a mix of scaled and unscaled frequencies."""
    factor, low_freq_factor, high_freq_factor = 8.0, 1.0, 4.0
    exponents = np.arange(0, spec.head_dim, 2, dtype=np.float64) / spec.head_dim
    wavelengths = 2 * np.pi * spec.rope_theta ** exponents
    smooth = (spec.context_length / wavelengths - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelengths < spec.context_length / high_freq_factor, 1.0,
                       np.where(wavelengths > spec.context_length / low_freq_factor, factor,
                                blended))
    return factors.astype(np.float32)


def tensor_plan(spec: ModelSpec, vocab_size: int) -> list[PlannedTensor]:
    """The model's tensors in file order, as its family's tensor map (tierflow.runtime.models)
    names and shapes them: the embeddings, each layer's fields (and its experts' stacks), then the
    output norm, head and rope factors (Llama 3's only when asked for)."""
    arch, config = architecture(spec.arch), spec_config(spec, vocab_size)
    fields = [f for f in arch.global_fields(config) if f.name != "rope_freqs" or spec.llama3_rope_freqs]
    plan = [t for f in fields if f.group == "embeddings" for t in _field_plan(f, spec)]
    for i in range(spec.num_layers + spec.nextn_layers):
        experts = arch.expert_fields(config, i, 0) if config.has_experts(i) else []
        if i < spec.num_layers:
            layer = arch.layer_fields(config, i)
        elif arch.mtp_fields is not None:
            layer = arch.mtp_fields(config)
        else:  # a block llama.cpp requires and skips: a layer's tensors and the nextn ones it requires
            nextn = [f for f in tm.nextn_fields(config, i) if f.name != "head_norm"]
            layer = arch.layer_fields(config, i) + nextn
        plan += [t for f in layer + experts if _written(f, spec) for t in _field_plan(f, spec)]
    for field in (f for f in fields if f.group != "embeddings"):
        if field.name == "rope_freqs":
            factors = _llama3_rope_factors(spec)
            plan.append(PlannedTensor("rope_freqs.weight", factors.shape, Q.F32, 0.0, values=factors))
        else:
            plan += _field_plan(field, spec)
    return plan


def _written(field: Field, spec: ModelSpec) -> bool:
    """Optional per-head q/k norms are written only when the spec asks for them; deepseek2's
    optional selection bias comes with sigmoid gating (V3's files), not softmax (V2's)."""
    optional = isinstance(field.kind, Vector) and field.kind.optional
    if optional and field.name == "exp_probs_b":
        return spec.expert_gating == "sigmoid"
    return not (optional and field.name in ("q_norm", "k_norm") and not spec.qk_norm)


def architecture_metadata(spec: ModelSpec, vocab_size: int) -> list[tuple[str, Typed]]:
    """The general.* and {arch}.* keys llama.cpp reads (the tokenizer keys come separately)."""
    arch = spec.arch

    def u32(value: int) -> Typed:
        return Typed(UINT32, value)

    def f32(value: float) -> Typed:
        return Typed(FLOAT32, value)

    metadata = [
        ("general.architecture", Typed(STRING, arch)),
        ("general.name", Typed(STRING, f"tierflow-random-{arch}-{spec.num_layers}x"
                                       f"{spec.hidden_size}" + _experts_label(spec))),
        ("general.file_type", u32((FILE_TYPES | MIXES)[spec.weight_type])),
        ("general.quantization_version", u32(gguf.GGML_QUANT_VERSION)),
        (f"{arch}.vocab_size", u32(vocab_size)),
        (f"{arch}.block_count", u32(spec.num_layers + spec.nextn_layers)),
        (f"{arch}.context_length", u32(spec.context_length)),
        (f"{arch}.embedding_length", u32(spec.hidden_size)),
    ]
    if ARCHS[arch].state_space:
        return metadata + _state_space_metadata(spec)
    metadata += [
        (f"{arch}.feed_forward_length", u32(spec.ffn_size)),
        *_expert_metadata(spec),
        (f"{arch}.attention.head_count", u32(spec.num_heads)),
        (f"{arch}.attention.head_count_kv", u32(spec.num_kv_heads)),
        (f"{arch}.attention.layer_norm_rms_epsilon", f32(1e-5)),
        (f"{arch}.rope.freq_base", f32(spec.rope_theta)),
        (f"{arch}.rope.dimension_count", u32(spec.rope_dim or spec.head_dim)),
    ]
    if spec.head_size is not None:
        metadata += [(f"{arch}.attention.key_length", u32(spec.head_size)),
                     (f"{arch}.attention.value_length", u32(spec.head_size))]
    if spec.rope_scaling is not None:
        metadata += [(f"{arch}.rope.scaling.type", Typed(STRING, spec.rope_scaling)),
                     (f"{arch}.rope.scaling.factor", f32(spec.rope_scaling_factor))]
    if spec.rope_scaling == "yarn":
        original = int(spec.context_length / spec.rope_scaling_factor)
        metadata.append((f"{arch}.rope.scaling.original_context_length", u32(original)))
    if spec.pooling_type is not None:
        metadata.append((f"{arch}.pooling_type", u32(spec.pooling_type)))
    if ARCHS[arch].nextn:
        metadata.append((f"{arch}.nextn_predict_layers", u32(spec.nextn_layers)))
    if ARCHS[arch].latent_attention:
        return _latent_metadata(spec, metadata)
    if ARCHS[arch].layer_pattern:
        return _hybrid_metadata(spec, metadata)
    if ARCHS[arch].parallel_hybrid:
        return metadata + _ssm_sizes(spec)
    if ARCHS[arch].linear_attention:
        return metadata + _linear_attention_metadata(spec)
    return metadata + _gemma_metadata(spec)


def _linear_attention_metadata(spec: ModelSpec) -> list[tuple[str, Typed]]:
    """qwen3next's and qwen35's keys: the DeltaNet layers' sizes, the interval of full-attention
    layers and qwen35's interleaved multi-section rotary's sections, covering every pair as
    Qwen3.5's [11, 11, 10, 0] do (text rotates the same in each; a pair left out would not turn)."""
    pairs = (spec.rope_dim or spec.head_dim) // 2
    sections = [-(-(pairs - i) // 3) for i in range(3)] + [0]  # interleaved: pair i in section i % 3
    keys = {"ssm.conv_kernel": spec.ssm_conv_kernel, "ssm.state_size": spec.ssm_state,
            "ssm.group_count": spec.ssm_key_heads, "ssm.time_step_rank": spec.ssm_value_heads,
            "ssm.inner_size": spec.ssm_inner,
            "full_attention_interval": spec.full_attention_interval}
    metadata = [(f"{spec.arch}.{key}", Typed(UINT32, value)) for key, value in keys.items()]
    if ARCHS[spec.arch].rope_sections:
        metadata.append((f"{spec.arch}.rope.dimension_sections", Typed(ARRAY, sections, INT32)))
    return metadata


def _state_space_metadata(spec: ModelSpec) -> list[tuple[str, Typed]]:
    """mamba's and mamba2's keys as llama.cpp's converter writes them: no FFN and no attention heads,
    the norms' epsilon and the ssm.* sizes."""
    keys = {"feed_forward_length": 0, "attention.head_count": 0, "attention.head_count_kv": 0}
    flag = [(f"{spec.arch}.ssm.dt_b_c_rms", Typed(BOOL, True))] if spec.ssm_dt_b_c_rms else []
    return [(f"{spec.arch}.{key}", Typed(UINT32, value)) for key, value in keys.items()] + [
        *_ssm_sizes(spec), (f"{spec.arch}.attention.layer_norm_rms_epsilon", Typed(FLOAT32, 1e-5)), *flag]


def _ssm_sizes(spec: ModelSpec) -> list[tuple[str, Typed]]:
    keys = {"ssm.conv_kernel": spec.ssm_conv_kernel, "ssm.inner_size": spec.ssm_inner,
            "ssm.state_size": spec.ssm_state, "ssm.time_step_rank": spec.ssm_value_heads,
            "ssm.group_count": spec.ssm_key_heads}
    return [(f"{spec.arch}.{key}", Typed(UINT32, value)) for key, value in keys.items()]


def _hybrid_metadata(spec: ModelSpec, metadata: list[tuple[str, Typed]]) -> list[tuple[str, Typed]]:
    """granitehybrid's, nemotron_h's and jamba's keys as llama.cpp's converter writes them: the layer pattern
    as head_count_kv per layer (0 but for attention) and, where the arch has FFN-only layers,
    feed_forward_length per layer (0 but for them); the ssm.* sizes; Granite's multipliers."""
    arch, pattern = spec.arch, spec.layer_pattern
    keys = {"attention.head_count_kv": Typed(ARRAY, [spec.num_kv_heads * (c == "*") for c in pattern], INT32)}
    if ARCHS[arch].layer_norm_eps_key:
        keys["attention.layer_norm_epsilon"] = Typed(FLOAT32, 1e-5)
    if "-" in ARCHS[arch].layer_pattern:
        keys["feed_forward_length"] = Typed(ARRAY, [spec.ffn_size * (c == "-") for c in pattern], INT32)
    if ARCHS[arch].granite_multipliers:
        scales = {"embedding_scale": spec.embedding_scale, "residual_scale": spec.residual_scale,
                  "logit_scale": spec.logit_scale, "attention.scale": spec.attention_scale}
        keys |= {key: Typed(FLOAT32, value) for key, value in scales.items() if value is not None}
        keys["rope.scaling.finetuned"] = Typed(BOOL, spec.rope)
    kept = [(key, value) for key, value in metadata if key.removeprefix(f"{arch}.") not in keys]
    return kept + [(f"{arch}.{key}", value) for key, value in keys.items()] + _ssm_sizes(spec)


def _latent_metadata(spec: ModelSpec, metadata: list[tuple[str, Typed]]) -> list[tuple[str, Typed]]:
    """deepseek2's keys as llama.cpp's converter writes them for the absorbed form: the cache's
    row widths as key_length / value_length, one KV head, the per-head sizes as *_mla."""
    arch, latent = spec.arch, spec.kv_lora_rank
    keys = {"attention.head_count_kv": Typed(UINT32, 1),
            "attention.key_length": Typed(UINT32, latent + spec.rope_dim),
            "attention.value_length": Typed(UINT32, latent),
            "attention.key_length_mla": Typed(UINT32, spec.head_dim),
            "attention.value_length_mla": Typed(UINT32, spec.value_head_size),
            "attention.kv_lora_rank": Typed(UINT32, latent),
            "attention.q_lora_rank": Typed(UINT32, spec.q_lora_rank),
            "expert_shared_count": Typed(UINT32, spec.shared_experts),
            "expert_gating_func": Typed(UINT32, 1 if spec.expert_gating == "softmax" else 2),
            "expert_weights_norm": Typed(BOOL, spec.expert_weights_norm),
            "expert_weights_scale": Typed(FLOAT32, spec.expert_weights_scale)}
    if spec.expert_groups > 1:
        keys["expert_group_count"] = Typed(UINT32, spec.expert_groups)
        keys["expert_group_used_count"] = Typed(UINT32, spec.expert_groups_used)
    if spec.yarn_log_multiplier is not None:
        keys["rope.scaling.yarn_log_multiplier"] = Typed(FLOAT32, spec.yarn_log_multiplier)
    kept = [(key, value) for key, value in metadata if key.removeprefix(f"{arch}.") not in keys]
    return kept + [(f"{arch}.{key}", value) for key, value in keys.items()]


def _gemma_metadata(spec: ModelSpec) -> list[tuple[str, Typed]]:
    window = spec.sliding_window or ARCHS[spec.arch].required_window or None
    keys = {"attention.sliding_window": (window, UINT32),
            "attn_logit_softcapping": (spec.attn_logit_softcap, FLOAT32),
            "final_logit_softcapping": (spec.final_logit_softcap, FLOAT32)}
    return [(f"{spec.arch}.{key}", Typed(kind, value)) for key, (value, kind) in keys.items()
            if value is not None]


def _experts_label(spec: ModelSpec) -> str:
    return f"-{spec.num_experts}e{spec.experts_used}" if spec.num_experts else ""


def _expert_metadata(spec: ModelSpec) -> list[tuple[str, Typed]]:
    if not spec.num_experts:
        return []
    arch, traits = spec.arch, ARCHS[spec.arch]
    metadata = [(f"{arch}.expert_count", Typed(UINT32, spec.num_experts)),
                (f"{arch}.expert_used_count", Typed(UINT32, spec.experts_used))]
    if traits.expert_width_key:
        metadata.append((f"{arch}.expert_feed_forward_length",
                         Typed(UINT32, spec.expert_ffn_width)))
    if traits.shared_expert:
        metadata.append((f"{arch}.expert_shared_feed_forward_length",
                         Typed(UINT32, spec.shared_expert_ffn_width)))
    if traits.scored_router:
        metadata += [(f"{arch}.expert_shared_count", Typed(UINT32, spec.shared_experts)),
                     (f"{arch}.expert_gating_func", Typed(UINT32, 2)),  # sigmoid
                     (f"{arch}.expert_weights_norm", Typed(BOOL, True)),
                     (f"{arch}.expert_weights_scale", Typed(FLOAT32, _EXPERT_WEIGHTS_SCALE))]
    if traits.leading_dense:
        metadata.append((f"{arch}.leading_dense_block_count", Typed(UINT32, spec.leading_dense_layers)))
    if spec.moe_latent_size:
        metadata.append((f"{arch}.moe_latent_size", Typed(UINT32, spec.moe_latent_size)))
    return metadata
