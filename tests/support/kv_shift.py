"""A context shift against a fresh prefill, for the tests of the KV cache on each tier."""

import threading

import numpy as np

NEVER = threading.Event()
# Prose that does not repeat itself (a repeated run would let a shift match it elsewhere): about
# 330 tokens with SmolLM2's vocabulary.
TEXT = (
    "The river town of Ashford began as a ford where drovers crossed with their cattle on the way to "
    "the autumn fairs. A miller named Tobias Reed built the first stone mill in 1612, and within a "
    "generation a chapel, two inns and a rope walk had gathered around it. The bridge came later, "
    "paid for by a toll that the townspeople resented for almost a century. When the canal reached "
    "the valley in 1794, barges brought coal from the northern pits and carried away wool, leather "
    "and the famous blue cheese that the dairies on the western slopes had made since medieval times. "
    "Ashford's population doubled in thirty years. Then the railway arrived, cutting through the old "
    "orchards with an embankment that still divides the town: the narrow streets of the old quarter "
    "on one side, the brick terraces of the mill workers on the other. A grammar school opened in "
    "1861, followed by a public library funded by a retired sea captain who had made his fortune "
    "trading tea in Canton. The great flood of 1903 swept away the wooden footbridge, drowned the "
    "cellars of every house along the quay and left a brown line on the church tower that visitors "
    "are still shown today. After the war the mills closed one by one; the last, a weaving shed "
    "employing four hundred people, shut its gates in 1968. Today the canal carries pleasure boats, "
    "the rope walk is a museum, and the cheese is sold in shops as far away as Tokyo and Buenos Aires."
)


def text_ids(engine, count: int) -> list[int]:
    ids = engine.tokenize(TEXT)
    assert len(ids) >= count
    return ids[:count]


def shifted_and_fresh_keys(engine, ids: list[int], keep: int, drop: int) -> tuple[np.ndarray, np.ndarray]:
    """The first layer's keys [K, n, D] of the tokens kept when ids[keep:keep + drop] are dropped:
    after prefilling ids and shifting, and after a fresh prefill of the kept tokens. (Only the
    first layer's keys depend on nothing but their token and position: later layers' moved keys
    were computed with the dropped tokens in view, as in llama.cpp.)"""
    kept = ids[:keep] + ids[keep + drop:]
    positions = np.arange(len(kept))
    with engine.exclusive() as generator:
        generator.prefill(ids, NEVER, reuse_prefix=False)
        generator.shift(keep, drop)
        shifted = generator.cache.read(0, positions)[0]
        generator.prefill(kept, NEVER, reuse_prefix=False)
        fresh = generator.cache.read(0, positions)[0]
    return shifted, fresh


def within_float_error(got: np.ndarray, expected: np.ndarray, relative: float = 1e-5) -> bool:
    return bool(np.abs(got - expected).max() <= relative * np.abs(expected).max())


# A half rounds to 11 significant bits: a shifted key and a fresh one, each rounded from floats a
# float32 error apart, are at most one half's step (2^-10 relative) apart.
HALF_STEP = 2.0**-10
