"""Engine: the public Python API. Load a GGUF model, then generate, stream, chat, score.

    engine = Engine.load()                       # bundled SmolLM2-135M-Instruct
    engine.generate("The capital of France is", max_tokens=8, temperature=0).text
    for piece in engine.chat_stream([{"role": "user", "content": "Hi"}]):
        print(piece, end="")

`from tierflow import Engine` imports this module, so an app pays for it at start-up: it imports
only light modules (numpy, the API's own types). The heavy collaborators (torch, llama.cpp, the
kernels, the loader, grammars, the template sandbox) are imported by the methods that use them,
Engine.load first, and so load with the first model (tests/test_import_cost.py).
"""

import asyncio
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from tierflow.arguments import (
    TOKEN_IDS,
    check_parallel,
    check_roles,
    flag,
    stop_strings,
    token_ids,
    utf8_encoded,
)
from tierflow.errors import BudgetError, ContextLengthError, InvalidArgumentError, TierflowError
from tierflow.offload.experts.expert_cache import CacheStats
from tierflow.offload.io.heap import give_back_freed_memory
from tierflow.offload.store.presets import Preset, find_preset
from tierflow.progress import LoadProgress
from tierflow.runtime.api.streams import AsyncStream, GenerationResult, Stream
from tierflow.runtime.sampling.sampler import Sampler, SamplingParams, as_count, recommended_sampling
from tierflow.runtime.sampling.schema_checks import check_schema
from tierflow.runtime.text.text_stream import TextStream
from tierflow.runtime.text.tool_calls import ToolCallStream, ToolFormat, parse_tool_calls, tool_format
from tierflow.units import format_size

if TYPE_CHECKING:
    from tierflow.offload.experts.routing_trace import RoutingRecorder
    from tierflow.runtime.generation.token_loop import TokenGenerator
    from tierflow.runtime.loading.loader import LoadedModel
    from tierflow.runtime.sampling.structured import Grammar, GrammarMatcher
    from tierflow.runtime.text.tokenizer import Tokenizer
    from tierflow.runtime.text.tool_prompt import ToolRequest
    from tierflow.speculative.choice import AutoSpeculator
    from tierflow.speculative.first_sizes import SpeculationPrior
    from tierflow.speculative.speculator import Speculator

PROMPT_THREADS = 2  # async prompts made at once (streams.py)
T = TypeVar("T")


class Engine:
    """A loaded model with its tokenizer and its sequences' KV caches.

    Each generation holds one sequence's slot (runtime/generation/slots.py): by default there is one, and
    calls from several threads take turns. Loaded with parallel=N, N generations run together,
    their passes batched into one sweep of the weights (runtime/generation/batching.py), and more wait.
    """

    def __init__(self, model: "LoadedModel", tokenizer: "Tokenizer", threads: int,
                 speculator: "Speculator | AutoSpeculator | None" = None, draft: "LoadedModel | None" = None,
                 sampling_defaults: dict | None = None, notices: tuple[str, ...] = (),
                 pooling: str = "mean"):
        from tierflow.runtime.generation.batching import PassBatcher
        from tierflow.runtime.generation.slots import SlotPool

        self.path: Path = model.path
        self.arch, self.config = model.arch, model.config  # the family (runtime/models/), its sizes
        self.plan = model.plan  # where every layer (and expert) lives and computes
        self.weights = model.weights
        self.tokenizer = tokenizer
        self.context_length = model.context_length
        # What the load decided that its caller should hear: a default context shortened to fit.
        self.notices = notices
        self.threads = threads
        self.speculator = speculator  # None: one token per pass
        self.draft = draft  # a draft model's weights, when the speculator runs one
        # What a generation's sampling keywords default to: the model file's recommendation
        # (general.sampling.*), over SamplingParams' own defaults.
        self.sampling_defaults = dict(sampling_defaults or {})
        # How embed() pools a text's hidden states: the file's {arch}.pooling_type, else "mean".
        self.pooling = pooling
        self.system_prompt: str | None = None  # a chat's system message when it gives none (a preset's)
        self._generator = model.generator  # the first sequence's; None once closed
        self._grammar_vocabulary = None  # llguidance's token table, built by the first constrained call
        self._slots = SlotPool(model.generators)
        # With several sequences, their passes are batched on one thread; alone, a generation
        # computes its passes itself.
        self._batcher = None
        if self._slots.size > 1:
            self._batcher = PassBatcher(model.generator.decoder, self._claim_threads)
            for generator in model.generators:
                generator.run_pass = self._batcher.run
        # Async generations are made on the prompt threads (a template's render may take up to its
        # time limit, and a second prompt need not wait for it), then run on the compute threads, as
        # many at a time as there are slots (see streams.py).
        self._prompts = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="tierflow-prompt")
        self._compute = ThreadPoolExecutor(max_workers=self._slots.size,
                                           thread_name_prefix="tierflow-compute")

    @classmethod
    def load(cls, model: str | os.PathLike | None = None, *, gpu_memory: int | str | None = None,
             cpu_memory: int | str | None = None, threads: int | None = None,
             context_length: int | None = None, progress: LoadProgress | None = None,
             gpu_device: str | None = None, draft: str | os.PathLike | None = None,
             draft_shape: str = "tree", draft_tokens: int | None = None, kv_cache_type: str | None = None,
             kv_on_cpu: bool = False, allow_context_extension: bool = False,
             parallel: int | str = 1, expert_placement: str | int = "auto", expert_skip: float = 0.0,
             expert_union_cap: int = 0, chat_template: str | os.PathLike | None = None) -> "Engine":
        """Loads a GGUF model (default: the bundled SmolLM2-135M-Instruct).

        gpu_memory and cpu_memory bound the bytes held on each tier ("4GiB", "512MB" or an int):
        the weights, and the KV cache of the layers computed there; cpu_memory also keeps room
        for the activations of a pass (default: the available RAM less a margin); a first load that
        measures the machine (offload/plan/probe.py) or writes the model's pack stays within it too,
        the probe within 10% of the available RAM if that is less. threads is
        the CPU thread count (default: physical cores). context_length is the positions the KV
        cache holds: by default the model's trained context if the budgets hold it, else the
        largest multiple of 256 they do (engine.notices says so); more than the model was
        trained on only with allow_context_extension. kv_cache_type is the cache's type: "f16"
        (default), "f32", "q8_0" or "q4_0" (llama.cpp's formats); kv_on_cpu keeps every
        layer's cache in RAM, the GPU layers' too (llama.cpp's -nkvo). progress(phase, done,
        total) follows the load (core/progress.py): phase a tierflow.LoadPhase, in order
        DOWNLOADING (bytes), PROBING (the machine measured, once: steps), PACKING (the weights laid
        out, once per file: the GGUF's bytes) and LOADING (bytes), each only when it happens, done
        counting up to total (0 while unknown), LOADING's last call with done == total; it is
        called on the thread doing the work: this one (aload's worker thread), or while PACKING
        the pack builder's threads, one call at a time. parallel is how many generations run
        together (from several threads, or AsyncStreams), each with its own KV cache of
        context_length positions (all within the budgets) and their passes batched: one sweep of
        the weights serves them all; more generations wait for a free one. parallel="auto" takes
        the most of 4, 2 or 1 that the budgets hold with at least 4096 positions each (or the
        model's context, if shorter): `tierflow serve`'s default.
        With gpu_memory, the first layers that fit run on the CUDA GPU with tierflow's Triton
        kernels, the rest on the CPU. Without a GPU, for testing: gpu_device="cpu" lets torch's
        CPU device stand in for the GPU tier, with the same budget, its layers computed by the
        CPU kernels; gpu_device="interpret" computes them with the GPU kernels in Triton's
        interpreter (slow: small models only). A mixture-of-experts model's layers (attention,
        routers, shared experts) go to the GPU first, and its experts on three tiers: a cache of the
        hot ones in the GPU memory left, the others in RAM, or on disk behind a cache in RAM when
        cpu_memory cannot hold them all. expert_placement places them by hand instead, with
        llama.cpp's meanings: "cpu" keeps every expert off the GPU (--cpu-moe), N the experts of
        layers 0..N-1 (--n-cpu-moe N) and puts all the others on the GPU, where they must fit.
        expert_skip (off: 0) trades exactness for fewer bytes read, as AdapMoE does: an expert that
        would be read from disk is skipped when every token that chose it gives it less than this
        share of its router weight (and it is no token's first choice); the token's other experts
        share its weight. expert_union_cap N (off: 0) caps the distinct experts each MoE layer of
        a token tree's verify pass computes (a tree's tokens together fire several times a decode
        token's experts): past N, its tokens' lesser choices are left out, those to be read from disk
        first. Both change the output; `tierflow plan` predicts what they save.
        draft turns on speculative decoding: "ngram" (prompt lookup: guesses from the context) or
        the path of a smaller GGUF with the same vocabulary (such as the target's own
        `tierflow convert --bits 3` version), which is placed first, within the budgets, and
        proposes a token tree (draft_shape "tree") or a chain ("chain") that the target verifies
        in one pass. Greedy output is the target's own, token for token; sampled output follows
        its distribution exactly. draft_tokens fixes the guesses per pass; by default the tree's
        size follows the measured cost of draft and verify passes and the tokens they gain
        (and prompt lookup guesses up to 16, fewer while they miss), starting from the size the
        plan's predicted costs favour, or what earlier loads of the same pair measured.
        draft "self:N" drafts with the target's own first N layers and its output head (an early
        exit: no second model, its layers held in memory, never streamed, with a KV cache of their
        own within the budgets); "self" tries a few depths on the first passes and keeps the
        fastest measured. "auto" (or "auto:FILE", with that draft file) picks among prompt
        lookup, the self-draft and the file by the planner's predicted tokens/s, then measures
        them (speculative/choice.py); engine.notices says what it chose.
        chat_template replaces the file's chat template: a Jinja file, Jinja text, or one of
        llama.cpp's built-in names ("chatml", "llama3", "gemma", "mistral-v7", "phi3", ...). A
        file without a template chats in ChatML, and engine.notices says so.

        model is a path, a model name (ollama's, the Hugging Face cache's, LM Studio's: see
        `tierflow list`) or a preset's name (offload/store/presets.py: its settings fill the options
        not given here, its sampling becomes sampling_defaults, its system prompt system_prompt). A
        Hugging Face name (Org/Model[:QUANT]) that is not on this disk is pulled first, reported as
        LoadPhase.DOWNLOADING, unless TIERFLOW_OFFLINE is set.
        """
        preset = find_preset(model)
        if preset is not None:
            options = {name: value for name, value in locals().items()
                       if name not in ("cls", "model", "preset")}  # every keyword given to load
            return cls.load(preset.model, **preset.filled(options))._with_preset(preset)
        from tierflow.offload.gguf.model_file import open_model_file
        from tierflow.offload.pack.writer import pack_sizes
        from tierflow.offload.store.model_path import find_or_pull
        from tierflow.runtime.api.embeddings import model_pooling
        from tierflow.runtime.loading.loader import (
            CacheOptions,
            expert_request,
            gpu_tier,
            load_model,
            load_tokenizer,
            profile_source,
            resolve_budgets,
            thread_count,
        )
        from tierflow.speculative.choice import draft_budgets, draft_speculator
        from tierflow.speculative.draft_loader import load_draft
        from tierflow.speculative.first_sizes import speculation_prior
        from tierflow.speculative.mtp import mtp_ram_bytes_within
        from tierflow.speculative.self_draft import parse_draft
        from tierflow.speculative.speculator import check_draft_options

        path = find_or_pull(model, progress)
        threads = thread_count(threads)
        gpu = gpu_tier(gpu_memory, gpu_device)
        check_draft_options(draft_shape, draft_tokens)
        cache = CacheOptions(context_length, kv_cache_type, flag("kv_on_cpu", kv_on_cpu),
                             flag("allow_context_extension", allow_context_extension),
                             check_parallel(parallel))
        with open_model_file(path) as target:  # validated before llama.cpp sees the file
            request = parse_draft(draft, target.config.num_layers)
            experts = expert_request(expert_placement, target.config, target.path.name, expert_skip,
                                     expert_union_cap)
            profile, sizes = profile_source(target, threads, gpu, progress, cpu_memory), pack_sizes(target)
            budgets = resolve_budgets(target, sizes, cpu_memory, gpu.budget, cache, profile, experts)
            tokenizer = load_tokenizer(target, chat_template)
            drafted = loaded = held = None  # held: what a draft took of the budgets before the target
            try:
                if request is not None and request.file is not None:
                    drafted = load_draft(request.file, target, budgets, gpu, progress)
                    held = ("the draft model", drafted.bytes_by_tier())
                if request is not None and request.kind == "mtp":
                    held = ("the MTP draft", {"cpu": mtp_ram_bytes_within(target, budgets), "gpu": 0})
                if held is not None:
                    budgets = budgets.less(held[1])
                if request is not None:
                    budgets = draft_budgets(request, target, sizes, budgets, profile, drafted, draft_shape,
                                            draft_tokens)
                try:
                    loaded = load_model(target, sizes, budgets, gpu, profile, progress)
                except BudgetError as error:
                    if held is None:
                        raise
                    (what, taken) = held
                    raise BudgetError(f"{error} (what is left after {what}, placed first, took "
                                      f"{format_size(taken['cpu'])} of RAM and {format_size(taken['gpu'])} "
                                      f"of GPU memory)") from error
                speculator, said = None, ()
                if request is not None:
                    def prior(model: "LoadedModel | None") -> "SpeculationPrior":
                        return speculation_prior(loaded, sizes, profile, threads, gpu, model, draft_shape)

                    speculator, said = draft_speculator(request, target, sizes, loaded, drafted, profile,
                                                        draft_shape, draft_tokens, prior)
            except BaseException:
                tokenizer.close()
                for model_loaded in (drafted, loaded):
                    if model_loaded is not None:
                        model_loaded.close()
                raise
        sampling_defaults = recommended_sampling(target.gguf.metadata, budgets.context_length)
        said += (tokenizer.template.notice,) if tokenizer.template.notice else ()
        return cls(loaded, tokenizer, threads, speculator, drafted, sampling_defaults, budgets.notices + said,
                   model_pooling(target.gguf.metadata, target.config.arch))

    # -- generation ------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 256,
                 stop: Sequence[str] | str | None = None, parse_special: bool = False,
                 response_format: dict | None = None, grammar: "Grammar | None" = None,
                 **sampling) -> GenerationResult:
        """Completes a prompt: text, or token ids (a sequence of ints or a 1-D integer numpy array).
        Text is text: "<|im_end|>" in it is those characters, not the special token, unless
        parse_special. Sampling keywords: temperature, top_k, top_p, min_p, repeat_penalty,
        repeat_last_n, seed, frequency_penalty, presence_penalty, logit_bias ({token id: bias});
        logprobs=True (and top_logprobs=N, up to 20) puts each token's log-probability in the
        result's logprobs (see SamplingParams, runtime/sampling/logprobs.py); those not given take
        sampling_defaults. An empty
        prompt is refused, unless the model starts every text with BOS: then "" is just BOS, as in
        llama.cpp. max_tokens=0 reads the prompt (into the KV cache, as llama.cpp's n_predict 0) and
        generates nothing (finish_reason "length"). A bad argument is an InvalidArgumentError.
        context_shift: see stream.

        response_format constrains the output as OpenAI's does: {"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; grammar does
        with a Grammar (runtime/sampling/structured.py: regex, Lark, GBNF, JSON schema). Every token is
        then one the grammar allows, and generation ends only where it may end (a max_tokens
        reached first cuts it off, finish_reason "length")."""
        stream = self.stream(prompt, max_tokens=max_tokens, stop=stop, parse_special=parse_special,
                             response_format=response_format, grammar=grammar, **sampling)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256,
               stop: Sequence[str] | str | None = None, parse_special: bool = False,
               context_shift: bool = False, response_format: dict | None = None,
               grammar: "Grammar | None" = None, **sampling) -> Stream:
        """Like generate, as a Stream of text pieces (whole UTF-8 characters); its .result is
        set once iterated to the end, and .cancel() stops it.

        context_shift says that the prompt continues a conversation whose oldest turns were
        dropped (runtime/generation/context_shift.py): the KV cache is then shifted rather than the kept
        history prefilled again. The shifted entries were computed with the dropped turns in
        view, so the output may differ from a fresh prefill's; without it, only entries a fresh
        prefill would write bit for bit are reused."""
        from tierflow.runtime.sampling.structured import grammar_for

        self._check_open()
        context_shift = flag("context_shift", context_shift)
        params = SamplingParams.from_keywords(self.sampling_defaults | sampling)
        max_tokens, stops = as_count("max_tokens", max_tokens), stop_strings(stop)
        grammar = grammar_for(response_format, grammar)
        prompt_ids = self._prompt_ids(prompt, flag("parse_special", parse_special))
        self._check_fits(len(prompt_ids), 1)
        sampler = Sampler(params, len(prompt_ids), self.config.vocab_size,
                          grammar and self._matcher(grammar, len(prompt_ids)))
        # Generation ends at the context's end, like llama.cpp, with finish_reason "length".
        max_tokens = min(max_tokens, self.context_length - len(prompt_ids))
        return Stream(self, prompt_ids, sampler, max_tokens, TextStream(stops), context_shift)

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Generates the assistant's reply to messages, using the model's chat template (keywords:
        chat_stream's)."""
        stream = self.chat_stream(messages, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def chat_stream(self, messages: list[dict], *, tools: list[dict] | None = None,
                    tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                    chat_template_kwargs: dict | None = None, **kwargs) -> Stream:
        """chat() as a Stream of text pieces (keywords: stream's, and the tools').

        tools, tool_choice and parallel_tool_calls are OpenAI's (runtime/text/tool_prompt.py): the
        tools go to the template, and the calls the answer makes come back parsed in the
        result's tool_calls (finish_reason "tool_calls"; text is the content around them), their
        text held back from the pieces. A call that does not parse stays text. Messages may hold
        assistant tool_calls and "tool" results, as OpenAI's do. chat_template_kwargs are more
        variables for the template, such as Qwen3's {"enable_thinking": False} or {"documents":
        [...]}."""
        from tierflow.runtime.text.tool_prompt import ToolRequest

        request = ToolRequest.from_openai(tools, tool_choice, parallel_tool_calls)
        prompt_ids = self.tokenize_chat(messages, tools=request, chat_template_kwargs=chat_template_kwargs)
        stream = self.stream(prompt_ids, **self._with_tool_grammar(request, kwargs))
        if request is not None and request.offered:
            stream.offer_tools(ToolCallStream(self.tool_format, request.names),
                               partial(self.with_tool_calls, tools=request))
        return stream

    def cancel(self) -> None:
        """Stops the running generations (from any thread); each returns what it has so far. A
        stream suspended between two pieces (its consumer has not asked for the next) ends now."""
        for holder in self._slots.holders():
            holder.cancel()
            if holder.suspended:
                holder.close()

    @contextmanager
    def exclusive(self, stream: "weakref.ReferenceType[Stream] | None" = None,
                  cancelled: threading.Event | None = None,
                  prompt_ids: Sequence[int] = ()) -> Iterator["TokenGenerator | None"]:
        """Holds a sequence's slot for one generation (streams.py): waits for a free one (the one
        whose cache holds the longest prefix of prompt_ids), then yields its token generator;
        yields None, having waited no more, once `cancelled` is set. `stream` (weakly referenced)
        is the stream that holds it, which cancel() stops. Not reentrant."""
        with self._slots.one(prompt_ids, cancelled, stream) as slot:
            if slot is None:
                yield None
                return
            if self._slots.busy == 1:
                self.weights.reset_peak()
            if self._batcher is None:
                self._claim_threads()
                yield self._slots.generators[slot]
                return
            with self._batcher.joined():
                yield self._slots.generators[slot]

    # -- async: the model runs on worker threads, the event loop never waits on it ----------

    @classmethod
    async def aload(cls, model: str | os.PathLike | None = None, **options) -> "Engine":
        """Engine.load (same arguments) on a worker thread: an app's event loop keeps running
        while the model loads (progress is called on that thread). Cancelled, it lets the load
        finish and closes the engine. The first load in a process also imports torch and llama.cpp
        there, and Python holds its lock while a C extension initialises: the loop pauses a few
        hundred milliseconds once, unless the app imported them earlier."""
        loading = _on_a_thread_of_its_own("tierflow-load", partial(cls.load, model, **options))
        try:
            return await asyncio.shield(asyncio.wrap_future(loading))
        except asyncio.CancelledError:
            # Called at once if the load has ended, else on its thread when it ends: no event loop
            # needs to be running then.
            loading.add_done_callback(_close_loaded)
            raise

    async def agenerate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """generate() for asyncio; cancelling the awaiting task cancels the generation."""
        stream = self.astream(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def astream(self, prompt: str | Sequence[int], **kwargs) -> AsyncStream:
        """stream() for asyncio: `async for piece in engine.astream(...)`. The prompt is tokenized
        (and a grammar compiled) on a worker thread, so a bad argument raises from the first step,
        or from `await stream.start()`."""
        self._check_open()
        return AsyncStream(partial(self.stream, prompt, **kwargs), self._prompts, self._compute)

    async def achat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """chat() for asyncio."""
        stream = self.achat_stream(messages, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def achat_stream(self, messages: list[dict], **kwargs) -> AsyncStream:
        """chat_stream() for asyncio; the chat template renders on a worker thread, as astream's
        prompt is tokenized."""
        self._check_open()
        return AsyncStream(partial(self.chat_stream, messages, **kwargs), self._prompts, self._compute)

    async def aclose(self) -> None:
        """close() on a worker thread: the event loop runs on while the generations stop and the
        memory is given back. Cancelled, the engine still closes; closing again does nothing."""
        await asyncio.shield(asyncio.wrap_future(_on_a_thread_of_its_own("tierflow-close", self.close)))

    # -- tokens and scores -----------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool | None = None,
                 parse_special: bool = False) -> list[int]:
        """Token ids of text (special-token strings in it stay text unless parse_special);
        add_bos None follows the model (see Tokenizer.encode)."""
        self._check_open()
        if add_bos is not None and not isinstance(add_bos, bool):
            raise InvalidArgumentError(f"add_bos must be True, False or None, got {add_bos!r}")
        return self._encode(text, "text", add_bos, flag("parse_special", parse_special))

    def tokenize_chat(self, messages: list[dict], *, tools: "ToolRequest | None" = None,
                      chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids chat() generates from: messages (and the tools offered, and the extra
        template variables) through the model's chat template, whose own markup alone becomes
        special tokens (a message holding "<|im_end|>" cannot end its turn or forge another). A
        message's role is one of system, user, assistant, tool and developer; another is an
        InvalidArgumentError naming it. Messages without a system message start with system_prompt,
        when there is one."""
        from tierflow.runtime.text.tool_prompt import template_inputs, template_variables

        self._check_open()
        check_roles(messages)
        if self.system_prompt is not None and isinstance(messages, list) and not any(
                isinstance(message, dict) and message.get("role") == "system" for message in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        extra = template_variables(chat_template_kwargs)
        messages, variables = template_inputs(messages, tools, self.tool_format)
        variables = {**extra, **variables}
        return utf8_encoded("the chat messages", lambda: self.tokenizer.encode_chat(messages, **variables))

    @property
    def tool_format(self) -> ToolFormat:
        """How this model's answers call tools, as its chat template says (runtime/text/tool_calls.py)."""
        return tool_format(self.tokenizer.template.jinja)

    def tool_grammar(self, tools: "ToolRequest | None") -> "Grammar | None":
        """The grammar that makes the answer well-formed calls, when tool_choice demands a call
        ("required" or a named function); None otherwise."""
        from tierflow.runtime.sampling.structured import Grammar
        from tierflow.runtime.text.tool_prompt import tool_call_grammar

        if tools is None or not tools.constrained:
            return None
        for tool in tools.callable_tools:
            function = tool["function"]
            check_schema(function["parameters"], f"the parameters of the tool {function['name']!r}")
        return Grammar.lark(tool_call_grammar(tools, self.tool_format, self.tokenizer.is_grammar_token))

    def with_tool_calls(self, result: GenerationResult, tools: "ToolRequest | None") -> GenerationResult:
        """result with the tool calls its text makes parsed out, if tools were offered: finish_reason
        "tool_calls", or for an answer max_tokens cut off, the calls whole before the cut and
        "length" (runtime/text/tool_calls.py)."""
        if tools is None or not tools.offered or result.finish_reason == "cancelled":
            return result
        cut = result.finish_reason == "length"
        parsed = parse_tool_calls(result.text, self.tool_format, tools.names, cut=cut)
        if not parsed.tool_calls:
            return result
        return replace(result, text=parsed.content, tool_calls=parsed.tool_calls,
                       finish_reason="length" if cut else "tool_calls")

    def detokenize(self, ids: Sequence[int]) -> str:
        self._check_open()
        return self.tokenizer.decode(self._check_ids(ids, "ids"))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] float32: the model's next-token scores at every position."""
        self._check_open()
        ids = self._check_ids(ids, "ids")
        if not ids:
            raise InvalidArgumentError("logits() needs at least one token id")
        self._check_fits(len(ids), 0)
        with self.exclusive(prompt_ids=ids) as generator:
            logits, _ = generator.prefill(ids, threading.Event(), all_logits=True, reuse_prefix=False)
        return logits

    def embed(self, inputs: str | Sequence[str | Sequence[int]], *, normalize: bool = True) -> np.ndarray:
        """Embeddings [N, E] float32, one row per input: a text (tokenized as llama.cpp embeds it,
        Tokenizer.encode_for_embedding) or token ids (used as they are). Each row pools the final-
        normed hidden states of its input's tokens as the model file declares ({arch}.pooling_type:
        "cls" the first token, "last" the last), by default their mean, then, if normalize, is
        scaled to unit L2 norm: llama.cpp's embeddings. Inputs that fit in one pass are computed
        together (runtime/api/embeddings.py). An empty input or list is an InvalidArgumentError; an
        input longer than the context a ContextLengthError. Generation's prefix reuse starts over
        afterwards (the pass writes the KV cache)."""
        from tierflow.runtime.api.embeddings import check_pooling, embed_inputs

        self._check_open()
        check_pooling(self.pooling, self.path.name)
        normalize = flag("normalize", normalize)
        ids = self.embedding_tokens(inputs)
        with self.exclusive() as generator:
            return embed_inputs(generator, ids, self.pooling, normalize)

    async def aembed(self, inputs: str | Sequence[str | Sequence[int]], *, normalize: bool = True
                     ) -> np.ndarray:
        """embed() for asyncio, on the engine's compute thread (after the generations queued there)."""
        self._check_open()
        return await asyncio.wrap_future(self._compute.submit(self.embed, inputs, normalize=normalize))

    def embedding_tokens(self, inputs: str | Sequence[str | Sequence[int]]) -> list[list[int]]:
        """The token ids embed() computes each input with (a text's as llama.cpp embeds it),
        checked: none empty, none longer than the context."""
        self._check_open()
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, Sequence) or isinstance(inputs, (bytes, bytearray)):
            raise InvalidArgumentError(f"inputs must be a str or a sequence of inputs (each a str or "
                                       f"{TOKEN_IDS}), not {type(inputs).__name__}")
        if not inputs:
            raise InvalidArgumentError("there is no input to embed: the list is empty")
        return [self._embedding_ids(item, i) for i, item in enumerate(inputs)]

    def _embedding_ids(self, item: str | Sequence[int], index: int) -> list[int]:
        name = f"input {index}"
        if isinstance(item, str):
            ids = [] if not item else utf8_encoded(name, self.tokenizer.encode_for_embedding, item)
        else:
            ids = self._check_ids(item, name, f"a str or {TOKEN_IDS}")
        if not ids:
            raise InvalidArgumentError(f"{name} is empty: there is no token to embed")
        if len(ids) > self.context_length:
            raise ContextLengthError(f"{name} has {len(ids)} tokens but the context holds "
                                     f"{self.context_length}")
        return ids

    @contextmanager
    def record_routing(self) -> Iterator["RoutingRecorder"]:
        """Records which experts every token computed the block's generations with, at every layer
        (a MoE model only): `recorder.trace()` is int32 [tokens, MoE layers, top_k], the routing-trace
        format benchmarks/moe.py replays (offload/experts/routing_trace.py), and `recorder.routing()`
        adds what the experts' early prediction picked for each. At the block's end the recording is
        kept beside the model's pack, where later plans take their hit rates and read-ahead from."""
        from tierflow.offload.experts.routing_trace import RoutingRecorder, keep_routing

        self._check_open()
        if not self.config.is_moe:
            raise InvalidArgumentError(f"{self.path.name} is not a mixture-of-experts model: it has no "
                                       f"routing to record")
        recorder = RoutingRecorder(self.config)
        decoder = self._generator.decoder
        with self._slots.every():  # not while a generation runs
            decoder.on_routing = recorder
        try:
            yield recorder
        finally:
            with self._slots.every():
                decoder.on_routing = None
        if recorder.recorded:
            keep_routing(self.path, recorder.routing())

    # -- lifetime --------------------------------------------------------------------------

    @property
    def parallel(self) -> int:
        """How many generations run together (each in its own sequence's slot)."""
        return self._slots.size

    @property
    def batched_passes(self) -> tuple[int, int]:
        """(passes, sequences they served) since the load, with parallel > 1: how well generations
        running together shared their passes; (0, 0) with one sequence."""
        if self._batcher is None:
            return 0, 0
        return self._batcher.passes, self._batcher.sequences_served

    @property
    def kv_cache_bytes(self) -> int:
        """The bytes the KV caches hold, every layer's of every sequence, wherever they are."""
        self._check_open()
        return sum(generator.cache.num_bytes for generator in self._slots.generators)

    @property
    def expert_stats(self) -> CacheStats | None:
        """What the expert cache did (per-layer hit rates, bytes fetched per token, predictions
        right and wrong), for a MoE model whose experts stream; None otherwise."""
        return None if self.weights.experts is None else self.weights.experts.stats

    def close(self) -> None:
        """Stops the running generation, then releases the weights, the KV cache and the tokenizer
        and hands the freed memory back to the system; the engine's threads (and the chat template's
        worker processes, once no engine is left) have ended when it returns. Later calls raise
        TierflowError, but closing again does nothing."""
        self.cancel()
        self._prompts.shutdown(wait=True, cancel_futures=True)
        self._compute.shutdown(wait=True, cancel_futures=True)
        with self._slots.every():
            if self._generator is None:  # closed already
                return
            if self._batcher is not None:
                self._batcher.close()
            if self.speculator is not None:
                self.speculator.save()  # what it learned, for the next load of the same pair
            self.tokenizer.close()
            self.weights.close()
            if self.draft is not None:
                self.draft.close()
            for generator in self._slots.generators:
                generator.release()
            self.weights = self._generator = self.draft = self._grammar_vocabulary = None
            self._batcher = None
        # The KV cache's and the activations' blocks are freed into the C allocator, which keeps
        # them (about the cache's size after a second load and close) unless asked to give them back.
        give_back_freed_memory()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _with_preset(self, preset: Preset) -> "Engine":
        self.sampling_defaults |= preset.sampling
        self.system_prompt = preset.system
        return self

    def _claim_threads(self) -> None:
        """Called by each generation under the lock: the kernels' pool runs on the engine's
        threads, and torch's pool does too unless the kernels do the matmuls (then torch keeps
        one thread: two pools spinning on the same cores slow each other down)."""
        import torch

        from tierflow.cpu_kernels import matmul as kernels

        kernels.set_threads(self.threads)
        torch.set_num_threads(1 if self.weights.uses_kernels else self.threads)

    def _prompt_ids(self, prompt: str | Sequence[int], parse_special: bool) -> list[int]:
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt", None, parse_special)
        else:
            ids = self._check_ids(prompt, "prompt", f"text (a str) or {TOKEN_IDS}")
        if not ids:
            raise InvalidArgumentError("the prompt is empty: there is no token to generate from")
        return ids

    def _encode(self, text: str, name: str, add_bos: bool | None, parse_special: bool) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"{name} must be a str, not {type(text).__name__}")
        return utf8_encoded(name, lambda: self.tokenizer.encode(text, add_bos=add_bos, special=parse_special))

    def _check_ids(self, ids: Sequence[int], name: str, must: str = TOKEN_IDS) -> list[int]:
        ids = token_ids(ids, name, must)
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return ids

    def _matcher(self, grammar: "Grammar", prompt_length: int) -> "GrammarMatcher":
        from tierflow.runtime.sampling.structured import GrammarMatcher, grammar_vocabulary

        if self._grammar_vocabulary is None:
            self._grammar_vocabulary = grammar_vocabulary(self.tokenizer, self.config.vocab_size)
        return GrammarMatcher(self._grammar_vocabulary, grammar, prompt_length)

    def _with_tool_grammar(self, tools: "ToolRequest | None", kwargs: dict) -> dict:
        grammar = self.tool_grammar(tools)
        if grammar is None:
            return kwargs
        if kwargs.get("grammar") is not None or kwargs.get("response_format") is not None:
            raise InvalidArgumentError(f"tool_choice {tools.choice!r} constrains the answer to a call: "
                                       f"give no grammar or response_format with it")
        return {**kwargs, "grammar": grammar}

    def _check_open(self) -> None:
        if self._generator is None:
            raise TierflowError("the engine is closed")

    def _check_fits(self, num_prompt_tokens: int, room: int) -> None:
        if num_prompt_tokens + room > self.context_length:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens but the context holds "
                f"{self.context_length}" + (" (one more is needed to generate)" if room else "")
            )


def _on_a_thread_of_its_own(name: str, work: Callable[[], T]) -> "Future[T]":
    """work() on a thread started for it, which ends with it."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    future = executor.submit(work)
    executor.shutdown(wait=False)
    return future


def _close_loaded(loading: "Future[Engine]") -> None:
    if not loading.cancelled() and loading.exception() is None:
        loading.result().close()
