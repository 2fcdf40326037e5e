"""Engine: the public Python API. Load a GGUF model, then generate, stream, chat, score.

    engine = Engine.load()                       # bundled SmolLM2-135M-Instruct
    engine.generate("The capital of France is", max_tokens=8, temperature=0).text
    for piece in engine.chat_stream([{"role": "user", "content": "Hi"}]):
        print(piece, end="")
"""

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil
import torch

from tierflow.cpu_kernels import matmul as kernels
from tierflow.errors import (
    BudgetError,
    ContextLengthError,
    InvalidArgumentError,
    ModelFileError,
    TierflowError,
)
from tierflow.gpu_kernels.launch import load_all_kernels
from tierflow.gpu_kernels.layer_kernels import TritonKernels
from tierflow.offload.device import DeviceTier
from tierflow.offload.expert_cache import CacheStats
from tierflow.offload.extents import expert_extents, model_extents
from tierflow.offload.gguf_file import read_gguf
from tierflow.offload.llama_vocab import llama_vocab_file
from tierflow.offload.model_info import read_config
from tierflow.offload.model_path import resolve_model_path
from tierflow.offload.packed_file import open_pack
from tierflow.offload.planner import (
    DEFAULT_CONTEXT_CAP,
    Plan,
    default_cpu_budget,
    kv_cache_bytes,
    make_plan,
)
from tierflow.offload.probe import load_profile
from tierflow.offload.profile import GpuProfile, HardwareProfile
from tierflow.offload.routing_trace import RoutingRecorder
from tierflow.offload.tensors import check_tensors
from tierflow.offload.tiered import LoadProgress, TieredWeights
from tierflow.runtime.config import ModelConfig
from tierflow.runtime.generation import TokenGenerator
from tierflow.runtime.kv_cache import KVCache
from tierflow.runtime.model import Decoder, Kernels
from tierflow.runtime.sampler import Sampler, SamplingParams
from tierflow.runtime.streams import AsyncStream, GenerationResult, Stream
from tierflow.runtime.text_stream import TextStream
from tierflow.runtime.tokenizer import Tokenizer
from tierflow.runtime.vocabulary import check_vocabulary
from tierflow.speculative.drafts import ModelDraft, NgramDraft
from tierflow.speculative.placement import LoadedDraft, load_draft
from tierflow.speculative.sizing import TreeBudget
from tierflow.speculative.speculator import Speculator
from tierflow.units import format_size, parse_size


class Engine:
    """A loaded model with its tokenizer, KV cache and generation lock.

    One generation runs at a time: calls from several threads queue on a lock, so the KV cache is
    never shared by two generations.
    """

    def __init__(self, path: Path, config: ModelConfig, weights: TieredWeights,
                 tokenizer: Tokenizer, context_length: int, threads: int,
                 speculator: Speculator | None = None, draft: LoadedDraft | None = None):
        self.path = path
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.threads = threads
        self.speculator = speculator  # None: one token per pass
        self.draft = draft  # a draft model's weights and cache, when the speculator runs one
        self._generator = TokenGenerator(Decoder(config, weights, context_length),
                                         KVCache(config, context_length, weights.allocate_cache))
        self._lock = threading.Lock()  # held by the one generation that runs
        self._active: Stream | None = None  # that generation
        # Async generations run here, one at a time, like the lock runs them (see streams.py).
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierflow-compute")

    @classmethod
    def load(cls, model: str | os.PathLike | None = None, *, gpu_memory: int | str | None = None,
             cpu_memory: int | str | None = None, threads: int | None = None,
             context_length: int | None = None, progress: LoadProgress | None = None,
             gpu_device: str | None = None, draft: str | os.PathLike | None = None,
             draft_shape: str = "tree", draft_tokens: int | None = None) -> "Engine":
        """Loads a GGUF model (default: the bundled SmolLM2-135M-Instruct).

        gpu_memory and cpu_memory bound the bytes held on each tier ("4GiB", "512MB" or an int):
        weights, and on the GPU the KV cache of the layers computed there; threads is the CPU
        thread count (default: physical cores); context_length the KV cache size (default: the
        model's, capped at 4096); progress(phase, done, total) is called as bytes load.
        With gpu_memory, the first layers that fit run on the CUDA GPU with tierflow's Triton
        kernels, the rest on the CPU. Without a GPU, for testing: gpu_device="cpu" lets torch's
        CPU device stand in for the GPU tier, with the same budget, its layers computed by the
        CPU kernels; gpu_device="interpret" computes them with the GPU kernels in Triton's
        interpreter (slow: small models only).
        draft turns on speculative decoding: "ngram" (prompt lookup: guesses from the context) or
        the path of a smaller GGUF with the same vocabulary (such as the target's own
        `tierflow convert --bits 3` version), which is placed first, within the budgets, and
        proposes a token tree (draft_shape "tree") or a chain ("chain") that the target verifies
        in one pass. Greedy output is the target's own, token for token; sampled output follows
        its distribution exactly. draft_tokens fixes the guesses per pass; by default the tree's
        size follows the measured cost of draft and verify passes and the tokens they gain
        (and prompt lookup guesses up to 16, fewer while they miss).
        """
        path = resolve_model_path(model)
        threads = _thread_count(threads)
        cpu_budget = parse_size(cpu_memory) if cpu_memory is not None else None
        gpu = _gpu_tier(gpu_memory, gpu_device)
        gpu_budget = gpu.budget
        if draft_shape not in ("tree", "chain"):
            raise InvalidArgumentError(f"draft_shape must be 'tree' or 'chain', not {draft_shape!r}")
        if draft_tokens is not None and (isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int)
                                         or not 1 <= draft_tokens <= MAX_TREE):
            raise InvalidArgumentError(f"draft_tokens must be an integer from 1 to {MAX_TREE}, "
                                       f"got {draft_tokens!r}")
        with read_gguf(path) as gguf:  # validated before llama.cpp sees the file
            config = read_config(gguf)
            context_length = _context_length(context_length, config)
            check_tensors(gguf, config)
            check_vocabulary(gguf.metadata, gguf.path.name)  # some bad ones abort llama.cpp
            with llama_vocab_file(gguf) as vocab_path:
                tokenizer = Tokenizer.from_gguf(vocab_path)
            loaded = None
            try:
                if tokenizer.vocab_size > config.vocab_size:
                    raise ModelFileError(
                        f"{path.name}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                        f"embedding only {config.vocab_size} rows"
                    )
                if draft not in (None, "ngram"):
                    loaded = load_draft(draft, gguf, config.vocab_size, context_length, cpu_budget,
                                        gpu_budget, gpu.device, gpu.kernels, progress)
                    held = loaded.bytes_by_tier()
                    cpu_budget = None if cpu_budget is None else cpu_budget - held["cpu"]
                    gpu_budget -= held["gpu"]
                try:
                    weights = _load_weights(gguf, config, cpu_budget, replace(gpu, budget=gpu_budget),
                                            threads, context_length, progress)
                except BudgetError as error:
                    if loaded is None:
                        raise
                    raise BudgetError(f"{error} (what is left after the draft model, placed first, took "
                                      f"{format_size(held['cpu'])} of RAM and {format_size(held['gpu'])} "
                                      f"of GPU memory)") from error
            except BaseException:
                tokenizer.close()
                if loaded is not None:
                    loaded.close()
                raise
        return cls(path, config, weights, tokenizer, context_length, threads,
                   _speculator(draft, draft_shape, draft_tokens, loaded, config.vocab_size), loaded)

    # -- generation ------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 256,
                 stop: Sequence[str] | str | None = None, **sampling) -> GenerationResult:
        """Completes a prompt (text, or token ids). Sampling keywords: temperature, top_k, top_p,
        min_p, repeat_penalty, repeat_last_n, seed (see SamplingParams)."""
        stream = self.stream(prompt, max_tokens=max_tokens, stop=stop, **sampling)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256,
               stop: Sequence[str] | str | None = None, **sampling) -> Stream:
        """Like generate, as a Stream of text pieces (whole UTF-8 characters); its .result is
        set once iterated to the end, and .cancel() stops it."""
        return self._stream(self._prompt_ids(prompt), max_tokens, stop, sampling)

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Generates the assistant's reply to messages, using the model's chat template."""
        return self.generate(self.tokenize_chat(messages), **kwargs)

    def chat_stream(self, messages: list[dict], **kwargs) -> Stream:
        return self.stream(self.tokenize_chat(messages), **kwargs)

    def cancel(self) -> None:
        """Stops the running generation (from any thread); it returns what it has so far."""
        active = self._active
        if active is not None:
            active.cancel()

    # -- async: the model runs on a worker thread, the event loop never waits on it ---------

    async def agenerate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """generate() for asyncio; cancelling the awaiting task cancels the generation."""
        stream = self.astream(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def astream(self, prompt: str | Sequence[int], **kwargs) -> AsyncStream:
        """stream() for asyncio: `async for piece in engine.astream(...)`."""
        return AsyncStream(self.stream(prompt, **kwargs), self._compute)

    async def achat(self, messages: list[dict], **kwargs) -> GenerationResult:
        return await self.agenerate(self.tokenize_chat(messages), **kwargs)

    def achat_stream(self, messages: list[dict], **kwargs) -> AsyncStream:
        return self.astream(self.tokenize_chat(messages), **kwargs)

    # -- tokens and scores -----------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        """The prompt ids chat() generates from: messages through the model's chat template."""
        self._check_open()
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_bos=None)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] float32: the model's next-token scores at every position."""
        self._check_open()
        ids = self._check_ids(ids)
        if not ids:
            raise InvalidArgumentError("logits() needs at least one token id")
        self._check_fits(len(ids), 0)
        with self._lock:
            self._claim_threads()
            logits, _ = self._generator.prefill(ids, threading.Event(), all_logits=True,
                                                reuse_prefix=False)
        return logits

    @contextmanager
    def record_routing(self) -> Iterator[RoutingRecorder]:
        """Records which experts every token computed the block's generations with, at every layer
        (a MoE model only): `recorder.trace()` is int32 [tokens, layers, top_k], the routing-trace
        format benchmarks/moe.py replays (offload/routing_trace.py)."""
        self._check_open()
        if not self.config.is_moe:
            raise InvalidArgumentError(f"{self.path.name} is not a mixture-of-experts model: it has no "
                                       f"routing to record")
        recorder = RoutingRecorder(self.config.num_layers)
        decoder = self._generator.decoder
        with self._lock:  # not while a generation runs
            decoder.on_routing = recorder
        try:
            yield recorder
        finally:
            with self._lock:
                decoder.on_routing = None

    # -- lifetime --------------------------------------------------------------------------

    @property
    def expert_stats(self) -> CacheStats | None:
        """What the expert cache did (per-layer hit rates, bytes fetched per token, predictions
        right and wrong), for a MoE model whose experts stream; None otherwise."""
        return None if self.weights.experts is None else self.weights.experts.stats

    def close(self) -> None:
        """Stops the running generation, then releases the weights, the KV cache and the tokenizer;
        later calls raise TierflowError. (Not from inside the iteration of the engine's own stream:
        that stream holds the lock close waits for.)"""
        self.cancel()
        self._compute.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self.tokenizer.close()
            self.weights.close()
            if self.draft is not None:
                self.draft.close()
            self.weights = self._generator = self.draft = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _claim_threads(self) -> None:
        """Called by each generation under the lock: the kernels' pool runs on the engine's
        threads, and torch's pool does too unless the kernels do the matmuls (then torch keeps
        one thread: two pools spinning on the same cores slow each other down)."""
        kernels.set_threads(self.threads)
        torch.set_num_threads(1 if self.weights.uses_kernels else self.threads)

    def _stream(self, prompt_ids: list[int], max_tokens: int, stop, sampling: dict) -> Stream:
        self._check_open()
        if max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        self._check_fits(len(prompt_ids), 1)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        sampler = Sampler(SamplingParams(**sampling))
        # Generation ends at the context's end, like llama.cpp, with finish_reason "length".
        max_tokens = min(max_tokens, self.context_length - len(prompt_ids))
        return Stream(self, prompt_ids, sampler, max_tokens, TextStream(stops))

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = self._check_ids(prompt)
        if not ids:
            raise InvalidArgumentError("the prompt has no tokens")
        return ids

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return ids

    def _check_open(self) -> None:
        if self._generator is None:
            raise TierflowError("the engine is closed")

    def _check_fits(self, num_prompt_tokens: int, room: int) -> None:
        if num_prompt_tokens + room > self.context_length:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens but the context holds "
                f"{self.context_length}" + (" (one more is needed to generate)" if room else "")
            )


MAX_GUESSES = 16  # prompt lookup's guesses per pass: 16 tokens cost about what 1 does here
MAX_TREE = 64  # a draft model's tree; TreeBudget finds the size that pays on this machine
MAX_CHAIN = 16


def _speculator(draft, shape: str, tokens: int | None, loaded: LoadedDraft | None,
                vocab_size: int) -> Speculator | None:
    if draft is None:
        return None
    if loaded is None:
        size = tokens or MAX_GUESSES
        return Speculator(NgramDraft(vocab_size, size), TreeBudget(size, start=4, fixed=tokens is not None))
    chain = shape == "chain"
    budget = TreeBudget(tokens or (MAX_CHAIN if chain else MAX_TREE), start=4 if chain else 8,
                        fixed=tokens is not None)
    return Speculator(ModelDraft(loaded.generator, max_width=1 if chain else 4), budget)


@dataclass(frozen=True)
class GpuTier:
    """Where layers placed on the GPU tier live and what computes them."""

    budget: int  # gpu_memory in bytes; 0: no GPU tier
    device: torch.device
    kernels: Kernels | None  # None: the CPU kernels (the CPU standing in for a GPU)


GPU_DEVICES = ("cpu", "interpret")


def _gpu_tier(gpu_memory: int | str | None, gpu_device: str | None) -> GpuTier:
    budget = parse_size(gpu_memory) if gpu_memory is not None else 0
    if gpu_device not in (None, *GPU_DEVICES):
        raise InvalidArgumentError(f"gpu_device must be 'cpu' or 'interpret' (the CPU standing in for a GPU, "
                                   f"for testing) or left out, not {gpu_device!r}")
    if gpu_device == "cpu" or budget == 0:
        return GpuTier(budget, torch.device("cpu"), None)
    if gpu_device == "interpret":
        try:
            load_all_kernels(interpret=True)
        except RuntimeError as error:  # Triton was imported without its interpreter
            raise InvalidArgumentError(f"gpu_device='interpret': {error}; set TRITON_INTERPRET=1 "
                                       f"first") from error
        return GpuTier(budget, torch.device("cpu"), TritonKernels(torch.device("cpu")))
    if not torch.cuda.is_available():
        raise BudgetError("gpu_memory was given but no CUDA GPU is available; omit it or use 0")
    load_all_kernels()  # a TritonUnavailableError that says how to get Triton, before any load
    device = torch.device("cuda", torch.cuda.current_device())
    return GpuTier(budget, device, TritonKernels(device))


def _load_weights(gguf, config: ModelConfig, cpu_budget: int | None, gpu: GpuTier, threads: int,
                  context_length: int, progress) -> TieredWeights:
    """The model's pack (built on first use) placed as planned. A pack found damaged while
    loading is rebuilt once."""
    plan = _plan(gguf, config, cpu_budget, gpu, threads, context_length, progress)
    experts = plan.experts if plan is not None else None
    expert_cache = gpu_experts = None
    if experts is not None and experts.cache == "cpu":  # home on disk, a cache in RAM
        expert_cache = config, experts.cache_bytes
    elif experts is not None and experts.cache == "gpu":  # home in RAM, a cache in VRAM
        gpu_experts = config, experts.cache_bytes, experts.scheduler

    def place(packed):
        device = DeviceTier(gpu.device, gpu.budget) if gpu.budget else None
        if plan is None:
            return TieredWeights(packed, (), 0, progress)
        return TieredWeights(packed, plan.streamed_layers, plan.prefetch_depth, progress, plan.gpu_layers,
                             device, gpu.kernels, expert_cache, gpu_experts)

    packed = open_pack(gguf, config, progress)
    try:
        return place(packed)
    except ModelFileError:
        packed.path.unlink(missing_ok=True)
        return place(open_pack(gguf, config, progress))


def _plan(gguf, config: ModelConfig, cpu_budget: int | None, gpu: GpuTier, threads: int,
          context_length: int, progress) -> Plan | None:
    """None when there is no GPU budget and the whole model fits cpu_memory (default: available
    RAM less a margin): everything stays in RAM, and the machine need not be measured. Otherwise
    the planner's plan, with this machine's measured profile (probed once and cached)."""
    globals_, layers = model_extents(gguf, config)
    experts = expert_extents(gguf, config)
    budget = cpu_budget
    if budget is None:
        budget = default_cpu_budget(kv_cache_bytes(config, context_length))
    whole = sum(x.nbytes for x in [globals_, *layers, *(x for layer in experts for x in layer)])
    if not gpu.budget and whole <= budget:
        return None
    return make_plan(gguf, config, _profile(gpu, threads, progress), gpu_budget=gpu.budget, cpu_budget=budget,
                     context_length=context_length)


def _profile(gpu: GpuTier, threads: int, progress) -> HardwareProfile:
    """This machine's measured profile (probed once and cached); the CPU standing in for a GPU
    gets the CPU's own speeds as the GPU's."""
    def measuring(step: str) -> None:  # a first streamed load on a machine probes it (~20 s)
        if progress is not None:
            progress(f"measuring this machine for the planner ({step})", 0, 0)

    profile = load_profile(threads, progress=measuring)
    if gpu.budget and gpu.device.type == "cpu":
        profile = replace(profile, gpu=GpuProfile("the CPU standing in for a GPU", gpu.budget,
                                                  profile.ram_read_gbps, dict(profile.kernel_gbps)))
    return profile


def _thread_count(threads: int | None) -> int:
    if threads is None:
        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
    return threads


def _context_length(requested: int | None, config: ModelConfig) -> int:
    if requested is None:
        return min(config.context_length, DEFAULT_CONTEXT_CAP)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise InvalidArgumentError(f"context_length must be a positive integer, got {requested!r}")
    if requested > config.context_length:
        raise ContextLengthError(
            f"context_length {requested} exceeds the model's {config.context_length}"
        )
    return requested
