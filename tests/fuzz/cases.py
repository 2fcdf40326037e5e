"""A fuzz case: a seed model and the mutations that turn it into the file under test.

    case = random_case(1234, seeds)   # the same number always gives the same case
    print(case)                       # its reproducer: the seed and every edit, in order
    data = case.build(seeds)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tests.fuzz.mutators import BYTE_WEIGHT, STRUCTURED_FAMILIES, byte_edit
from tests.fuzz.seeds import Seed


@dataclass(frozen=True)
class Case:
    seed: str  # a name of seeds.SEED_SPECS
    edits: tuple[Any, ...] = ()  # structured mutations, applied in order to the seed's parts
    byte_edits: tuple[Any, ...] = ()  # then these, in order, to the written bytes

    def build(self, seeds: dict[str, Seed]) -> bytes:
        seed = seeds[self.seed]
        parts = seed.parts.copy()
        for edit in self.edits:
            edit.apply(parts, seed)
        data = parts.to_bytes()
        for edit in self.byte_edits:
            data = edit.apply(data, seeds)
        return data

    def __str__(self) -> str:
        edits = "; ".join(map(str, self.edits + self.byte_edits))
        return f"seed model {self.seed!r}: {edits or 'unchanged'}"


def random_case(number: int, seeds: dict[str, Seed]) -> Case:
    """Case `number`: a seed model and one to three edits, all drawn from random.Random(number)."""
    rng = random.Random(number)
    seed = seeds[rng.choice(sorted(seeds))]
    families = list(STRUCTURED_FAMILIES.values())
    structured_weight = sum(weight for weight, _ in families)
    edits, byte_edits = [], []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        if rng.randrange(structured_weight + BYTE_WEIGHT) < BYTE_WEIGHT:
            byte_edits.append(byte_edit(rng, seed, seeds))
        else:
            mutator = rng.choices([mutator for _, mutator in families], [weight for weight, _ in families])[0]
            edits.append(mutator(rng, seed))
    return Case(seed.name, tuple(edits), tuple(byte_edits))
