"""Quality of requantized models: how far their next-token distributions move from the original.

    python -m benchmarks.quality [--model PATH] [--bits 4 3 2] [--methods rtn search]
                                 [--threads 2] [--json]

For each bit width and method the model is converted (`tierflow.offload.gguf.convert.convert_model`)
into a temporary directory. Each model, the original included, then scores the same fixed text
(benchmarks/quality_text.txt, ~400 tokens of plain English prose) in one forward pass
(`Engine.logits`), and at every position the converted model's next-token distribution Q is
compared with the original's P:
- KL: mean over positions of KL(P || Q) in nats, the information lost per token;
- top-1: how often both pick the same most likely token;
- PPL: the perplexity of the text itself (the next token's probability), original and converted.
The table also gives each file's size and bits per weight, over the whole file and over the
requantized layer weights alone (the embedding stays as it was), and the conversion time.
"""

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tests.support.oracle import log_softmax, perplexity
from tierflow import Engine
from tierflow.offload.gguf.convert import convert_model
from tierflow.offload.store.model_path import resolve_model_path

TEXT = Path(__file__).with_name("quality_text.txt")


@dataclass
class Row:
    bits: int
    method: str
    quant_type: str
    file_mib: float
    bits_per_weight: float  # whole file
    layer_bits_per_weight: float  # requantized tensors only
    mean_kl: float  # nats per token
    top1_agreement: float
    perplexity: float
    convert_seconds: float


def score(path: Path, ids: list[int], threads: int) -> np.ndarray:
    """Log-probabilities [T, V] of the next token at every position of `ids`."""
    with Engine.load(path, threads=threads, context_length=len(ids)) as engine:
        return log_softmax(engine.logits(ids))


def compare(reference: np.ndarray, log_probs: np.ndarray) -> tuple[float, float]:
    """Mean KL(P || Q) over positions and the top-1 agreement, P the reference."""
    kl = (np.exp(reference) * (reference - log_probs)).sum(axis=-1)
    agreement = (reference.argmax(-1) == log_probs.argmax(-1)).mean()
    return float(kl.mean()), float(agreement)


def tokenize(path: Path) -> list[int]:
    with Engine.load(path, threads=1, context_length=64) as engine:
        return engine.tokenize(TEXT.read_text())


def measure(model: Path, bits_list: list[int], methods: list[str],
            threads: int) -> tuple[int, float, list[Row]]:
    """The text's token count, the original's perplexity on it, and a row per conversion."""
    ids = tokenize(model)
    reference = score(model, ids, threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierflow-quality-") as directory:
        for bits in bits_list:
            for method in methods:
                path = Path(directory) / f"{model.stem}-{bits}bit-{method}.gguf"
                report = convert_model(model, path, bits, method)
                log_probs = score(path, ids, threads)
                kl, agreement = compare(reference, log_probs)
                rows.append(Row(bits, method, report.quant_type, report.file_bytes / 2**20,
                                report.bits_per_weight, report.requantized_bits_per_weight, kl,
                                agreement, perplexity(log_probs, ids), report.seconds))
                path.unlink()
                print(f"  {bits} bits {method}: KL {kl:.4f}", file=sys.stderr, flush=True)
    return len(ids), perplexity(reference, ids), rows


def print_table(model: Path, num_tokens: int, reference_ppl: float, rows: list[Row]) -> None:
    print(f"{model.name}: {num_tokens} tokens of {TEXT.name}; original perplexity "
          f"{reference_ppl:.2f}, file {model.stat().st_size / 2**20:.1f} MiB")
    print("| bits | method | type  | file MiB | bits/weight (file) | bits/weight (layers) "
          "| mean KL (nats) | top-1 agree | perplexity | convert s |")
    print("| ---- | ------ | ----- | -------- | ------------------ | -------------------- "
          "| -------------- | ----------- | ---------- | --------- |")
    for r in rows:
        print(f"| {r.bits} | {r.method} | {r.quant_type} | {r.file_mib:.1f} | "
              f"{r.bits_per_weight:.2f} | {r.layer_bits_per_weight:.1f} | {r.mean_kl:.4f} | "
              f"{r.top1_agreement:.1%} | {r.perplexity:.2f} | {r.convert_seconds:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: bundled)")
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    parser.add_argument("--methods", nargs="+", default=["rtn", "search"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    num_tokens, reference_ppl, rows = measure(model, args.bits, args.methods, args.threads)
    if args.json:
        print(json.dumps({"model": str(model), "tokens": num_tokens, "perplexity": reference_ppl,
                          "rows": [asdict(row) for row in rows]}, indent=2))
    else:
        print_table(model, num_tokens, reference_ppl, rows)


if __name__ == "__main__":
    main()
