"""tierflow against llama.cpp on the same GGUF file: logits and greedy tokens."""

import numpy as np
import pytest

PROMPTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the largest planet in the solar system?\nA:",
]
LONG_TEXT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "into chemical energy. Inside the chloroplasts, chlorophyll absorbs mostly blue and red "
    "light, and the energy splits water molecules, releasing oxygen. The captured energy is "
    "stored in ATP and NADPH, which the Calvin cycle then uses to fix carbon dioxide into sugars."
)


def llama_cpp_logits(llama, ids: list[int]) -> np.ndarray:
    llama.reset()
    llama.eval(ids)
    return np.array(llama.scores[: len(ids)], dtype=np.float32)


def llama_cpp_greedy(llama, ids: list[int], max_tokens: int, eog_ids) -> list[int]:
    out = []
    for token in llama.generate(ids, top_k=1, temp=0.0, reset=True):
        if token in eog_ids or len(out) == max_tokens:
            break
        out.append(token)
    return out


def test_logits_match_llama_cpp_on_a_64_token_prompt(engine, oracle):
    ids = engine.tokenize(LONG_TEXT)[:64]
    assert len(ids) == 64
    ours = engine.logits(ids)
    theirs = llama_cpp_logits(oracle, ids)
    assert ours.shape == theirs.shape == (64, engine.config.vocab_size)
    mean_abs_diff = float(np.abs(ours - theirs).mean())
    print(f"mean |logit difference| vs llama.cpp: {mean_abs_diff:.4f}")
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert mean_abs_diff < 0.1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_llama_cpp(engine, oracle, prompt):
    ids = engine.tokenize(prompt)
    ours = engine.generate(ids, max_tokens=64, temperature=0).tokens
    theirs = llama_cpp_greedy(oracle, ids, 64, engine.tokenizer.eog_ids)
    assert ours == theirs
