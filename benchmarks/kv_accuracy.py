"""What the KV cache's type costs the logits, in tierflow and in llama.cpp, against the exact model.

    python -m benchmarks.kv_accuracy [--model PATH] [--tokens 256] [--windows 11] [--nudges 2]
                                     [--threads 2] [--json]

Windows of --tokens tokens of real prose (the benchmarks' and the tests' texts, cut one after the
other; each window a sequence of its own from position 0) are scored in one pass by each system and
cache type. "Exact" is llama.cpp on the model's F32 copy (tests/support/make_model.write_f32_copy)
with an F32 cache and no flash attention (with flash attention llama.cpp casts an F32 cache to f16);
tierflow on the same copy is printed beside it (they agree to ~1e-5). For each run the mean
|logit - exact| over every position of every window is reported, with its range over the windows:

- on the model file (by default the bundled Q4_1 SmolLM2): tierflow with an f32 and an f16 cache,
  llama.cpp with an f32 cache, its default f16 cache (no flash attention) and f16 with flash
  attention; and tierflow's f32 cache with each attention output nudged by a relative 2^-20 (random
  signs, one seed per --nudges): a change a thousand times smaller than f16's rounding, which shows
  how far any change at all moves a quantized model's logits (both sides round the activations to
  8 bits before each quantized matmul, and a nudge flips a rounding here and there, which
  compounds). Beside each, how far it moved the logits from the same side's f32 cache.
- on the F32 copy, where the cache is the only rounding: tierflow's f16 cache and llama.cpp's
  (default and flash attention), against exact.
"""

import argparse
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tests.support.make_model import write_f32_copy
from tierflow import Engine
from tierflow.offload.store.model_path import resolve_model_path
from tierflow.runtime.compute.cpu import CPU_KERNELS

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "benchmarks" / "quality_text.txt", ROOT / "tests" / "support" / "perplexity_text.txt",
         ROOT / "benchmarks" / "routing_text.txt", ROOT / "tests" / "support" / "moe_calibration.txt"]
NUDGE = 2.0**-20  # relative; f16 rounds by up to 2^-11


def windows(model: Path, tokens: int, count: int) -> list[list[int]]:
    """Up to `count` windows of `tokens` ids, cut from the texts in order."""
    with Engine.load(model, threads=1, context_length=64) as engine:
        cut = []
        for text in TEXTS:
            ids = engine.tokenize(text.read_text())
            cut += [ids[i:i + tokens] for i in range(0, len(ids) - tokens + 1, tokens)]
    return cut[:count]


@contextmanager
def nudged_attention(seed: int):
    """Every CPU attention output times 1 + NUDGE * (random +-1), the signs drawn from `seed`."""
    rng, plain = np.random.default_rng(seed), CPU_KERNELS.attention

    def attention(*args, **kwargs):
        out = plain(*args, **kwargs)
        signs = rng.integers(0, 2, out.shape).astype(np.float32) * 2 - 1
        return out * (1 + np.float32(NUDGE) * signs)

    CPU_KERNELS.attention = attention
    try:
        yield
    finally:
        del CPU_KERNELS.attention


def tierflow_logits(path: Path, kv: str, chunks: list[list[int]], threads: int,
                    nudge_seed: int | None = None) -> list[np.ndarray]:
    with Engine.load(path, threads=threads, context_length=len(chunks[0]), kv_cache_type=kv) as engine:
        if nudge_seed is None:
            return [engine.logits(ids) for ids in chunks]
        with nudged_attention(nudge_seed):
            return [engine.logits(ids) for ids in chunks]


def llama_cpp_logits(path: Path, kv: str, flash_attn: bool, chunks: list[list[int]],
                     threads: int) -> list[np.ndarray]:
    import llama_cpp

    kv_type = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[kv]
    llama = llama_cpp.Llama(str(path), n_ctx=len(chunks[0]), n_batch=len(chunks[0]), logits_all=True,
                            n_threads=threads, verbose=False, type_k=kv_type, type_v=kv_type,
                            flash_attn=flash_attn)
    out = []
    for ids in chunks:
        llama.reset()
        llama.eval(ids)
        out.append(np.array(llama.scores[:len(ids)], dtype=np.float32))
    llama.close()
    return out


def per_window(runs: list[np.ndarray], reference: list[np.ndarray]) -> np.ndarray:
    """Mean |difference| of each window."""
    return np.array([np.abs(a - b).mean() for a, b in zip(runs, reference)])


def measure(model: Path, tokens: int, count: int, nudges: int, threads: int) -> dict:
    chunks = windows(model, tokens, count)
    with tempfile.TemporaryDirectory(prefix="tierflow-kv-accuracy-") as folder:
        f32_copy = write_f32_copy(model, Path(folder) / "f32.gguf")
        exact = llama_cpp_logits(f32_copy, "f32", False, chunks, threads)
        ours_exact = tierflow_logits(f32_copy, "f32", chunks, threads)
        on_copy = {
            "tierflow f16": tierflow_logits(f32_copy, "f16", chunks, threads),
            "llama.cpp f16": llama_cpp_logits(f32_copy, "f16", False, chunks, threads),
            "llama.cpp f16, flash attention": llama_cpp_logits(f32_copy, "f16", True, chunks, threads),
        }
    ours_f32 = tierflow_logits(model, "f32", chunks, threads)
    theirs_f32 = llama_cpp_logits(model, "f32", False, chunks, threads)
    # (run, the same side's f32 run that "moved" is measured from)
    on_file = {
        "tierflow f32": (ours_f32, ours_f32),
        "tierflow f16": (tierflow_logits(model, "f16", chunks, threads), ours_f32),
        **{f"tierflow f32, nudge {seed}": (tierflow_logits(model, "f32", chunks, threads, seed), ours_f32)
           for seed in range(nudges)},
        "llama.cpp f32": (theirs_f32, theirs_f32),
        "llama.cpp f16": (llama_cpp_logits(model, "f16", False, chunks, threads), theirs_f32),
        "llama.cpp f16, flash attention": (llama_cpp_logits(model, "f16", True, chunks, threads), theirs_f32),
    }

    def row(runs, base=None) -> dict:
        error = per_window(runs, exact)
        result = {"error": float(error.mean()), "window_min": float(error.min()),
                  "window_max": float(error.max()), "windows": [round(float(x), 5) for x in error]}
        if base is not None:
            result["moved"] = float(per_window(runs, base).mean())
        return result

    return {
        "model": str(model), "windows": len(chunks), "tokens": tokens,
        "tierflow_vs_llama_cpp_exact": float(per_window(ours_exact, exact).mean()),
        "on_file": {name: row(runs, base) for name, (runs, base) in on_file.items()},
        "on_f32_copy": {name: row(runs) for name, runs in on_copy.items()},
    }


def print_report(report: dict) -> None:
    print(f"{report['model']}: {report['windows']} windows of {report['tokens']} tokens")
    print(f"exact: llama.cpp on the F32 copy, F32 cache (tierflow there: "
          f"{report['tierflow_vs_llama_cpp_exact']:.1e} from it)")
    print("\nmean |logit - exact| on the file (range over windows); moved: from the same side's f32 cache")
    file_rows = report["on_file"]
    for name, row in file_rows.items():
        print(f"  {name:32s} {row['error']:.4f}  ({row['window_min']:.3f} .. {row['window_max']:.3f})"
              f"  moved {row['moved']:.4f}")
    for side in ("tierflow", "llama.cpp"):
        f32 = np.array(file_rows[f"{side} f32"]["windows"])
        f16 = np.array(file_rows[f"{side} f16"]["windows"])
        ratio = f16 / f32
        print(f"  {side} f16 / f32: {f16.mean() / f32.mean():.3f} over all windows, "
              f"{ratio.min():.2f} .. {ratio.max():.2f} per window")
    print("\nmean |logit - exact| on the F32 copy (the cache's rounding alone)")
    for name, row in report["on_f32_copy"].items():
        print(f"  {name:32s} {row['error']:.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: bundled)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per window")
    parser.add_argument("--windows", type=int, default=11, help="at most this many windows")
    parser.add_argument("--nudges", type=int, default=2, help="nudged runs of tierflow's f32 cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    report = measure(resolve_model_path(args.model), args.tokens, args.windows, args.nudges, args.threads)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
