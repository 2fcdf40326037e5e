"""Decode tokens/s at long contexts, per KV cache type: tierflow against llama.cpp with the same
cache type, in one run, with the bytes each cache holds; and how far each type moves the logits.

    python -m benchmarks.long_context [--contexts 1024,8192,32768] [--types f32,f16,q8_0,q4_0]
                                      [--decode-tokens 16] [--threads 2] [--accuracy-context 8192]
                                      [--json]

The model is a generated Llama-3.2-1B-shaped file (tests/support/make_model.py: 16 layers, hidden
2048, 32 query heads, 8 key/value heads of 64, Q8_0 weights), cached in tierflow's cache folder.

Filling a 32k context by prefill would take this 2-core machine most of an hour per system and
type, and decode speed does not depend on what the cache holds, only on how much of it there is.
So both caches are filled without computing: tierflow's rows are written into its KVCache
(random keys and values, stored in the type), llama.cpp's are loaded as a sequence state built
from the rows of a short real prefill, repeated. Then both decode the same tokens from there:
a few untimed single-token passes, then `--decode-tokens` more (greedy argmax), timed, the median
step reported.

llama.cpp gets flash attention for the quantized types (its CPU path needs it to store V
quantized), and not for f32/f16, as `-ctk/-ctv` users run it.

Accuracy: an F32 copy of the bundled model (the oracle's exact regime: its Q4_1 file's matmuls
round activations to 8 bits, and that rounding turns any change of a key into a larger one)
prefills `--accuracy-context` tokens once per type; the logits of its last 32 positions are
compared with f32's: mean |difference| / std(f32 logits).
"""

import argparse
import ctypes
import json
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import llama_cpp
import numpy as np

from benchmarks.decode import build_prompt
from tierflow import Engine
from tierflow.kv_types import KV_TYPES
from tierflow.offload.plan.profile import cache_dir
from tierflow.offload.store.model_path import bundled_model_path

LLAMA_1B = dict(arch="llama", num_layers=16, hidden_size=2048, ffn_size=8192, num_heads=32,
                num_kv_heads=8, context_length=131072, weight_type="Q8_0", embedding_type="Q8_0")
ACCURACY_POSITIONS = 32
# untimed decode steps at each context: the first passes of a load run measurably slower (the first
# row of a run once read 12 tok/s where the same load warm reads 22)
WARM_UP_STEPS = 3


def bundled_f32_copy() -> Path:
    from tests.support.make_model import write_f32_copy

    path = cache_dir("bench") / "smollm2-135m-f32.gguf"
    if not path.exists():
        write_f32_copy(bundled_model_path(), path.with_suffix(".tmp")).rename(path)
    return path


def llama_1b_model() -> Path:
    from tests.support.make_model import ModelSpec, write_model

    path = cache_dir("bench") / "llama-1b-shape-Q8_0.gguf"
    if not path.exists():
        print("writing the Llama-3.2-1B-shaped model (once) ...", file=sys.stderr)
        write_model(path.with_suffix(".tmp"), ModelSpec(**LLAMA_1B)).rename(path)
    return path


# -- tierflow ---------------------------------------------------------------------------------

def tierflow_decode(engine: Engine, contexts: list[int], steps: int) -> dict[int, float]:
    """Median seconds per decode step at each context, its cache filled with random rows."""
    rng = np.random.default_rng(0)
    seconds = {}
    with engine.exclusive() as generator:
        cache, decoder, config = generator.cache, generator.decoder, engine.config
        filled = 0
        for context in contexts:
            positions = np.arange(filled, context)
            for layer in range(config.num_layers):
                keys, values = (rng.standard_normal((config.num_kv_heads, len(positions), config.head_dim),
                                                    np.float32) for _ in range(2))
                cache.write(layer, positions, keys, values)
            filled = context
            times = []
            token = 1000
            for step in range(WARM_UP_STEPS + steps):
                cache.length = context + step
                started = time.perf_counter()
                logits = decoder.forward(np.array([token]), cache)
                times.append(time.perf_counter() - started)
                token = int(np.argmax(logits[-1]))
            del times[:WARM_UP_STEPS]
            seconds[context] = statistics.median(times)
        generator.cached_tokens = []  # the cache holds no real prompt now
        cache.truncate(0)
    return seconds


# -- llama.cpp --------------------------------------------------------------------------------

def llama_cpp_decode(path: Path, kv: str, contexts: list[int], steps: int, threads: int) -> dict[int, float]:
    """Median seconds per decode step at each context, its cache loaded as a synthesized state."""
    type_id = KV_TYPES[kv].ggml_id
    llama = llama_cpp.Llama(str(path), n_ctx=max(contexts) + WARM_UP_STEPS + steps + 32, n_batch=512,
                            n_threads=threads, n_threads_batch=threads, type_k=type_id, type_v=type_id,
                            flash_attn=kv.startswith("q"), verbose=False)
    try:
        seed = list(range(1000, 1032))
        llama.eval(seed)
        state = SeqState.read(llama, len(seed))
        seconds = {}
        for context in contexts:
            llama.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)
            state.load(llama, context)
            llama.n_tokens = context
            times = []
            token = 1000
            for _ in range(WARM_UP_STEPS + steps):
                started = time.perf_counter()
                llama.eval([token])
                times.append(time.perf_counter() - started)
                token = _argmax_last(llama)
            del times[:WARM_UP_STEPS]
            seconds[context] = statistics.median(times)
        return seconds
    finally:
        llama.close()


def _argmax_last(llama: llama_cpp.Llama) -> int:
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama.ctx, -1), shape=(llama.n_vocab(),))
    return int(np.argmax(logits))


class SeqState:
    """Sequence 0's state as llama.cpp writes it (llama_state_seq_get_data), split into its parts so
    that a state of any number of cells can be built from a real one:

        head (u32 x 3; the last: streams), cell count u32, per cell: pos i32, 1 u32, seq id 0 i32,
        v_trans u32, layers u32, per layer K: type i32, row bytes u64, a row per cell; then per
        layer V: the same, or with v_trans (no flash attention) type i32, element bytes u32,
        features u32, and per feature an element per cell.

    The layout is checked against the state's length; a llama.cpp that writes another one is
    refused with a message rather than fed a state it would misread."""

    def __init__(self, head: bytes, v_trans: int, layers: int, tensors: list[tuple[bytes, list[bytes], int]]):
        # per tensor: its header, its runs (a row per cell, or per feature an element per cell),
        # and the bytes each run holds per cell
        self.head, self.v_trans, self.layers, self.tensors = head, v_trans, layers, tensors

    @classmethod
    def read(cls, llama: llama_cpp.Llama, cells: int) -> "SeqState":
        size = llama_cpp.llama_state_seq_get_size(llama.ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        llama_cpp.llama_state_seq_get_data(llama.ctx, buffer, size, 0)
        data = bytes(buffer)
        head, count = data[:12], struct.unpack_from("<I", data, 12)[0]
        if count != cells:
            raise RuntimeError(f"llama.cpp's state layout is not one this benchmark knows (cells {count})")
        at = 16 + 12 * cells
        v_trans, layers = struct.unpack_from("<II", data, at)
        at += 8
        tensors = []
        for index in range(2 * layers):
            if v_trans and index >= layers:
                header = data[at:at + 12]
                _, element, features = struct.unpack("<iII", header)
                runs, per_cell = features, element
            else:
                header = data[at:at + 12]
                _, per_cell = struct.unpack("<iQ", header)
                runs = 1
            at += 12
            run_bytes = per_cell * cells
            tensors.append((header, [data[at + i * run_bytes:at + (i + 1) * run_bytes] for i in range(runs)],
                            per_cell))
            at += runs * run_bytes
        if at != len(data):
            raise RuntimeError(f"llama.cpp's state layout is not one this benchmark knows ({len(data) - at} "
                               f"bytes left over)")
        return cls(head, v_trans, layers, tensors)

    def load(self, llama: llama_cpp.Llama, cells: int) -> None:
        positions = np.stack([np.arange(cells), np.ones(cells), np.zeros(cells)], 1).astype("<i4")
        parts = [self.head, struct.pack("<I", cells), positions.tobytes(),
                 struct.pack("<II", self.v_trans, self.layers)]
        for header, runs, per_cell in self.tensors:
            parts.append(header)
            for run in runs:
                parts.append((run * -(-cells * per_cell // len(run)))[:cells * per_cell])
        data = b"".join(parts)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama_cpp.llama_state_seq_set_data(llama.ctx, buffer, len(data), 0) != len(data):
            raise RuntimeError(f"llama.cpp refused a state of {cells} cells")


# -- accuracy ---------------------------------------------------------------------------------

def logits_drift(types: list[str], context: int, threads: int) -> dict[str, float]:
    """Per type, mean |logits - f32's| / std(f32's) over the last positions of one long prompt."""
    last, model = {}, bundled_f32_copy()
    for kv in dict.fromkeys(["f32", *types]):
        with Engine.load(model, threads=threads, context_length=context, kv_cache_type=kv) as engine:
            ids = build_prompt(engine, context)
            with engine.exclusive() as generator:
                generator.prefill(ids[:-ACCURACY_POSITIONS], threading.Event())
                last[kv], _ = generator.prefill(ids, threading.Event(), all_logits=True)
    reference = last["f32"]
    return {kv: float(np.abs(logits - reference).mean() / reference.std()) for kv, logits in last.items()}


# -- the run ----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    path = Path(args.model) if args.model else llama_1b_model()
    steps, rows = args.decode_tokens, []
    for kv in args.types:
        context = max(args.contexts) + WARM_UP_STEPS + steps
        with Engine.load(path, threads=args.threads, context_length=context, kv_cache_type=kv) as engine:
            held = engine.kv_cache_bytes
            ours = tierflow_decode(engine, args.contexts, steps)
        theirs = llama_cpp_decode(path, kv, args.contexts, steps, args.threads)
        for context in args.contexts:
            rows.append({"type": kv, "context": context, "tierflow_tokens_per_s": 1 / ours[context],
                         "llama_cpp_tokens_per_s": 1 / theirs[context],
                         "ratio": theirs[context] / ours[context], "tierflow_cache_bytes": held})
    drift = logits_drift(args.types, args.accuracy_context, args.threads) if args.accuracy_context else {}
    return {"model": path.name, "threads": args.threads, "decode_tokens": steps, "rows": rows,
            "logits_drift": drift, "accuracy_context": args.accuracy_context}


def print_table(report: dict) -> None:
    print(f"model: {report['model']}; {report['threads']} threads; median of {report['decode_tokens']} "
          f"decode steps")
    print(f"{'type':<6}{'context':>9}{'tierflow tok/s':>16}{'llama.cpp tok/s':>17}{'ratio':>8}"
          f"{'cache held':>12}")
    for row in report["rows"]:
        print(f"{row['type']:<6}{row['context']:>9}{row['tierflow_tokens_per_s']:>16.2f}"
              f"{row['llama_cpp_tokens_per_s']:>17.2f}{row['ratio']:>7.2f}x"
              f"{row['tierflow_cache_bytes'] / 2**30:>9.2f} GiB")
    for kv, drift in report["logits_drift"].items():
        print(f"logits drift of {kv} vs f32 at {report['accuracy_context']} tokens (bundled model, F32): "
              f"{100 * drift:.3f}% of the logits' std")


def parse_args(argv: list[str]) -> argparse.Namespace:
    def numbers(text: str) -> list[int]:
        values = sorted(int(part) for part in text.split(","))
        if not values or values[0] < 64:
            raise argparse.ArgumentTypeError("contexts must be integers of at least 64")
        return values

    def types(text: str) -> list[str]:
        names = text.split(",")
        unknown = [name for name in names if name not in KV_TYPES]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown KV cache types {unknown}: valid: {list(KV_TYPES)}")
        return names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the generated Llama-3.2-1B shape)")
    parser.add_argument("--contexts", type=numbers, default=[1024, 8192, 32768])
    parser.add_argument("--types", type=types, default=list(KV_TYPES))
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--accuracy-context", type=int, default=8192,
                        help="prefill length of the logits comparison; 0 skips it")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
