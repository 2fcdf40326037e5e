"""Layers on the GPU tier computed by the GPU kernels, end to end through the engine.

With CUDA the layers run on the GPU; without it, `gpu_device="interpret"` runs the same launchers
in Triton's interpreter on the CPU standing in for the GPU (slow, so the models are tiny). The
CPU-only engine on the same file is the reference: the same greedy tokens, and logits within the
gap between the CPU kernels' int8 activations and the GPU kernels' unquantized ones.
"""


import numpy as np
import pytest
import torch

from tests.support.gpu import load_gpu_kernels_or_skip
from tests.support.kv_shift import shifted_and_fresh_keys, text_ids, within_float_error
from tests.support.make_model import ModelSpec, write_model
from tests.support.model_spec import family_spec
from tests.support.together import generate_together
from tierflow import Engine
from tierflow.errors import BudgetError
from tierflow.gpu_kernels.layer_kernels import TritonKernels
from tierflow.offload.tiers.device import DeviceTier

pytestmark = pytest.mark.slow  # each pass through Triton's interpreter takes seconds

CUDA = load_gpu_kernels_or_skip()
GPU = {} if CUDA else {"gpu_device": "interpret"}
PROMPT = "The capital of France is"
CONTEXT = 64
TOKENS = 3  # greedy tokens compared: each pass through Triton's interpreter takes seconds
NGRAM_TOKENS = 6  # prompt lookup drafts once the answer repeats itself


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-layers")
    specs = {"llama-Q8_0": ModelSpec(num_layers=2, hidden_size=64, seed=3),
             "llama-Q4_0": ModelSpec(num_layers=2, hidden_size=64, weight_type="Q4_0", seed=4),
             # 4-bit codebook indices, looked up by the kernels
             "llama-IQ4_NL": ModelSpec(num_layers=2, hidden_size=64, weight_type="IQ4_NL", seed=4),
             "qwen2-F32": ModelSpec(arch="qwen2", num_layers=2, hidden_size=64, weight_type="F32",
                                    embedding_type="F32", seed=5),
             # per-head q/k norms: a device path that dropped them would change every logit
             "qwen3-Q8_0": ModelSpec(arch="qwen3", num_layers=2, hidden_size=64, head_size=32, seed=6),
             # sandwich norms, GeGLU, a window of 3 the prompt crosses, and soft caps
             "gemma2-Q8_0": ModelSpec(arch="gemma2", num_layers=2, hidden_size=64, head_size=32,
                                      sliding_window=3, attn_logit_softcap=2.0, seed=7)}
    return {name: write_model(folder / f"{name}.gguf", spec) for name, spec in specs.items()}


def cpu_result(path, draft=None, kv_cache_type=None, max_tokens=TOKENS):
    with Engine.load(path, threads=2, context_length=CONTEXT, draft=draft,
                     kv_cache_type=kv_cache_type) as engine:
        tokens = engine.generate(PROMPT, max_tokens=max_tokens, temperature=0).tokens
        return tokens, engine.logits(engine.tokenize(PROMPT) + tokens)


@pytest.mark.parametrize("name", ["llama-Q8_0", "llama-Q4_0", "llama-IQ4_NL", "qwen2-F32", "qwen3-Q8_0",
                                  "gemma2-Q8_0"])
def test_layers_on_the_gpu_give_the_cpu_tokens_and_logits(models, name):
    tokens, logits = cpu_result(models[name])
    with Engine.load(models[name], threads=2, context_length=CONTEXT, gpu_memory="64MiB", **GPU) as engine:
        assert engine.weights.gpu_layers == [0, 1]
        assert all(isinstance(engine.weights.layer(i).kernels, TritonKernels) for i in (0, 1))
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == tokens
        got = engine.logits(engine.tokenize(PROMPT) + tokens)
    assert np.abs(got - logits).max() < 0.05 * np.abs(logits).max()
    assert np.abs(got - logits).mean() < 0.005 * np.abs(logits).max()


STATE_SPACE_FAMILIES = ("mamba", "mamba2", "granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon-h1",
                        "jamba")


@pytest.mark.parametrize("family", STATE_SPACE_FAMILIES)
def test_each_state_space_familys_layers_on_the_gpu_give_the_cpu_tokens(tmp_path, family):
    path = write_model(tmp_path / "model.gguf", family_spec(family))
    tokens, _ = cpu_result(path)
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory="64MiB", **GPU) as engine:
        assert engine.plan.gpu_layers == tuple(range(engine.config.num_layers))  # their states there too
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == tokens


@pytest.mark.parametrize("kv_on_cpu", [False, True])
def test_generations_run_together_on_gpu_layers_each_give_their_own_tokens(models, kv_on_cpu):
    prompts = [PROMPT, "Once upon a time"]
    with Engine.load(models["llama-Q8_0"], threads=2, context_length=CONTEXT, gpu_memory="64MiB",
                     parallel=2, kv_on_cpu=kv_on_cpu, **GPU) as engine:
        tokens = TOKENS
        alone = [engine.generate(prompt, max_tokens=tokens, temperature=0).tokens for prompt in prompts]
        passes_before = engine.batched_passes[0]
        assert generate_together(engine, prompts, max_tokens=tokens, temperature=0) == alone
        assert engine.batched_passes[0] - passes_before < 2 * (tokens + 1)  # shared, not taken in turn


def test_activations_cross_between_gpu_and_cpu_layers(models):
    path = models["llama-Q8_0"]
    tokens, _ = cpu_result(path)
    kv_per_layer = 2 * 2 * CONTEXT * 16 * 4  # keys and values, 2 heads of 16, float32
    with Engine.load(path, threads=2, context_length=CONTEXT, **GPU) as probe:
        one_layer = probe.weights.packed.layers[0].nbytes + kv_per_layer
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory=one_layer, **GPU) as engine:
        assert engine.weights.gpu_layers == [0]
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == tokens


def test_a_gpu_layers_kv_cache_lives_on_the_gpu_within_the_budget(models):
    with Engine.load(models["llama-Q8_0"], threads=2, context_length=CONTEXT, gpu_memory="64MiB",
                     **GPU) as engine:
        cache = engine._generator.cache
        assert all(isinstance(keys, torch.Tensor) and keys.device == engine.weights.device.device
                   for keys in cache.keys)
        layers = sum(engine.weights.packed.layers[i].nbytes for i in (0, 1))
        assert engine.weights.bytes_by_tier()["gpu"] == layers + cache.num_bytes


def test_a_shift_of_a_kv_cache_on_the_gpu_gives_the_first_layer_the_keys_a_fresh_prefill_writes(models):
    with Engine.load(models["qwen2-F32"], threads=2, context_length=CONTEXT, gpu_memory="64MiB",
                     kv_cache_type="f32", **GPU) as engine:  # the rotation exactly, no storage rounding
        assert isinstance(engine._generator.cache.keys[0], torch.Tensor)
        # Few tokens: the interpreter's prefill grows faster than the tokens (64 took a minute).
        shifted, fresh = shifted_and_fresh_keys(engine, text_ids(engine, 24), keep=4, drop=10)
    assert within_float_error(shifted, fresh)


def test_kv_on_cpu_attends_on_the_cpu_over_caches_in_ram_and_keeps_the_tokens(models):
    path = models["llama-Q8_0"]
    tokens, _ = cpu_result(path, max_tokens=NGRAM_TOKENS)
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory="64MiB", kv_on_cpu=True,
                     draft="ngram", **GPU) as engine:  # verify passes too attend over the RAM cache
        assert engine.weights.gpu_layers == [0, 1] and engine.plan.kv_gpu_bytes == 0
        assert all(isinstance(keys, np.ndarray) for keys in engine._generator.cache.keys)
        result = engine.generate(PROMPT, max_tokens=NGRAM_TOKENS, temperature=0)
    assert result.tokens == tokens and result.stats.drafted_tokens > 0


def test_token_trees_verified_on_gpu_layers_keep_the_greedy_tokens(models):
    path = models["llama-Q8_0"]
    tokens, _ = cpu_result(path, max_tokens=NGRAM_TOKENS)
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory="64MiB", draft="ngram",
                     **GPU) as engine:
        result = engine.generate(PROMPT, max_tokens=NGRAM_TOKENS, temperature=0)
    assert result.tokens == tokens and result.stats.drafted_tokens > 0


def test_experts_cached_on_the_gpu_run_its_kernels_and_keep_the_cpu_tokens(tmp_path):
    spec = ModelSpec(num_layers=2, hidden_size=64, num_experts=4, experts_used=2, weight_type="Q4_0", seed=8)
    got, logits = experts_on_the_gpu_and_cpu(write_model(tmp_path / "moe.gguf", spec))
    assert np.abs(got - logits).max() < 0.05 * np.abs(logits).max()


def experts_on_the_gpu_and_cpu(path) -> tuple[np.ndarray, np.ndarray]:
    """(the logits with a GPU expert cache, the CPU's) over the prompt and the CPU's greedy tokens,
    once the greedy tokens agree and experts ran on the GPU. Both caches f32: with a lossy one, the
    two devices' last-bit differences in a key flip a random model's top-2-of-4 routing at some
    positions, and a flipped expert moves the logits by far more."""
    tokens, logits = cpu_result(path, kv_cache_type="f32")
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory="1MiB", kv_cache_type="f32",
                     **GPU) as engine:
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == tokens
        got = engine.logits(engine.tokenize(PROMPT) + tokens)
        assert engine.weights.experts.schedules.on_gpu + engine.weights.experts.schedules.fetched > 0
    return got, logits


def test_deepseek2_experts_cached_on_the_gpu_keep_the_cpu_tokens(tmp_path):
    """A MoE model's layers stay on the CPU, so deepseek2's latent attention runs there; its routed
    experts (sigmoid gating with the selection bias) run on the GPU kernels."""
    spec = ModelSpec(arch="deepseek2", num_layers=2, hidden_size=64, num_heads=4, head_size=48, rope_dim=16,
                     num_experts=4, experts_used=2, expert_ffn_size=32, q_lora_rank=32,
                     expert_gating="sigmoid", seed=8)
    got, logits = experts_on_the_gpu_and_cpu(write_model(tmp_path / "deepseek2.gguf", spec))
    assert np.abs(got - logits).max() < 0.05 * np.abs(logits).max()


def test_glm4moe_experts_cached_on_the_gpu_keep_the_cpu_tokens(tmp_path):
    """A dense first layer (no experts to cache), then sigmoid-scored experts with a selection bias
    and an ungated shared expert. (Seed 10: every greedy step of this random model is decided by a
    margin of 0.6 or more; seed 9's fifth is a tie within 0.011, which the devices' roundings split.)"""
    spec = ModelSpec(arch="glm4moe", num_layers=2, hidden_size=64, num_experts=4, experts_used=2,
                     expert_ffn_size=64, leading_dense_layers=1, rope_dim=8, weight_type="Q4_0", seed=10)
    got, logits = experts_on_the_gpu_and_cpu(write_model(tmp_path / "glm4moe.gguf", spec))
    assert np.abs(got - logits).max() < 0.05 * np.abs(logits).max()


def test_gpt_oss_mxfp4_experts_cached_on_the_gpu_keep_the_cpu_tokens(tmp_path):
    """gpt-oss as shipped: its experts MXFP4, 4-bit codebook indices on the GPU as in RAM. Its
    top-2-of-4 router nearly ties at some position of this random model, where the devices' different
    activation rounding picks another expert (as against llama.cpp, tests/support/oracle.py): the
    logits agree at every other position."""
    spec = ModelSpec(arch="gpt-oss", num_layers=2, hidden_size=64, num_experts=4, experts_used=2,
                     sliding_window=16, expert_type="MXFP4", seed=8)
    got, logits = experts_on_the_gpu_and_cpu(write_model(tmp_path / "gpt-oss.gguf", spec))
    per_position = np.abs(got - logits).max(axis=-1) / np.abs(logits).max()
    assert (per_position >= 0.05).sum() <= 1


def test_running_out_of_gpu_memory_mid_generation_names_the_budget_and_leaves_the_engine_usable(
        models, monkeypatch):
    path = models["llama-Q8_0"]
    tokens, _ = cpu_result(path)
    attention = TritonKernels.attention

    def out_of_memory(*args):
        monkeypatch.setattr(TritonKernels, "attention", attention)  # once
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory="64MiB", **GPU) as engine:
        monkeypatch.setattr(TritonKernels, "attention", out_of_memory)
        with pytest.raises(BudgetError, match="lower gpu_memory"):
            engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == tokens


def test_running_out_of_gpu_memory_in_a_load_is_a_budget_error_that_holds_nothing(monkeypatch):
    tier = DeviceTier(torch.device("cpu"), budget=1 << 20)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(torch, "zeros", out_of_memory)
    with pytest.raises(BudgetError, match="lower gpu_memory"):
        tier.zeros((16, 16))
    assert tier.used == 0
