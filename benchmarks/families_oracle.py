"""Every MoE family and weight type against llama.cpp: how far tierflow's logits lie from its.

    python -m benchmarks.families_oracle [--families qwen3moe,gpt-oss] [--types Q8_0,Q4_K]
                                         [--tokens 64] [--json]

Each family's model is written by the project's generator (random weights, small shapes whose rows
fit every K-quant) once per weight type, and both systems score the same prompt ids in one pass:
- F32 weights with llama.cpp's KV cache in F32: the exact regime, where both compute in float32 and
  the mean |logit difference| is rounding;
- each quantized type: llama.cpp rounds the activations to 8 bits before every quantized matmul
  and tierflow does not, so the figures are quantization noise; a router's choice can flip where two
  experts nearly tie (the tests allow it at a few positions), so the median per position is shown
  beside the mean, and how often both pick the same top token.
The tests (tests/test_oracle.py, test_glm4moe.py, test_deepseek2.py) hold each figure to its bound;
this prints them all in one table.
"""

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import LONG_TEXT, llama_cpp_logits, llama_cpp_model
from tierflow import Engine

SHAPE = dict(num_layers=2, hidden_size=256, ffn_size=512, num_heads=4, num_kv_heads=2, context_length=512)
FAMILIES = {
    "mixtral": dict(arch="llama", num_experts=4, experts_used=2),
    "qwen2moe": dict(arch="qwen2moe", num_experts=4, experts_used=2),
    "olmoe": dict(arch="olmoe", num_experts=8, experts_used=2, num_kv_heads=4),
    "qwen3moe": dict(arch="qwen3moe", num_experts=8, experts_used=3, expert_ffn_size=256, head_size=128),
    "glm4moe": dict(arch="glm4moe", num_layers=3, num_experts=8, experts_used=2, expert_ffn_size=256,
                    leading_dense_layers=1, nextn_layers=1, rope_dim=32, qk_norm=True, tied_embeddings=False),
    "gpt-oss": dict(arch="gpt-oss", num_experts=4, experts_used=2, sliding_window=16, rope_scaling="yarn",
                    rope_scaling_factor=4.0),
    "deepseek2": dict(arch="deepseek2", num_layers=3, num_experts=8, experts_used=2, expert_ffn_size=256,
                      head_size=320, rope_dim=64, kv_lora_rank=256, value_head_size=256, q_lora_rank=256,
                      leading_dense_layers=1, expert_gating="sigmoid", expert_weights_norm=True,
                      rope_scaling="yarn", rope_scaling_factor=4.0),
}
TYPES = ["F32", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "MXFP4",
         "TQ2_0", "TQ1_0"]
CONTEXT = 256


def compare(family: str, weight_type: str, folder: Path, tokens: int) -> dict:
    spec = ModelSpec(**(SHAPE | FAMILIES[family] | dict(weight_type=weight_type, embedding_type=weight_type)))
    path = write_model(folder / f"{family}-{weight_type}.gguf", spec)
    exact = weight_type == "F32"
    with Engine.load(path, threads=2, context_length=CONTEXT, kv_cache_type="f32") as engine:
        ids = engine.tokenize(LONG_TEXT)[:tokens]
        ours = engine.logits(ids)
    llama = llama_cpp_model(path, n_ctx=CONTEXT, f32_kv=exact)
    try:
        theirs = llama_cpp_logits(llama, ids)
    finally:
        llama.close()
    per_position = np.abs(ours - theirs).mean(-1)
    return {"family": family, "weight_type": weight_type, "mean": float(per_position.mean()),
            "median": float(np.median(per_position)),
            "top1_agree": float((ours.argmax(-1) == theirs.argmax(-1)).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", type=lambda text: text.split(","), default=list(FAMILIES))
    parser.add_argument("--types", type=lambda text: text.split(","), default=TYPES)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [compare(family, weight_type, Path(folder), args.tokens)
                for family in args.families for weight_type in args.types]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"mean | median |logit difference| per position against llama.cpp, and top-1 agreement, "
          f"{args.tokens} tokens (F32: llama.cpp's KV in F32, the exact regime)")
    print(f"{'type':<8}" + "".join(f"{family:>22}" for family in args.families))
    for weight_type in args.types:
        cells = [next(r for r in rows if r["family"] == f and r["weight_type"] == weight_type)
                 for f in args.families]
        print(f"{weight_type:<8}" + "".join(
            f"{c['mean']:>9.2g} {c['median']:>6.2g} {c['top1_agree']:>5.0%}" for c in cells))


if __name__ == "__main__":
    main()
