"""Random renderable directive sets of a workload template, for the template tests."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from commweave.contracts.program import load_program, parse_program
from commweave.space import DirectiveSet, directives_of


def renderable_samples(template: Any, shape: Any, world: int, seed: int, tries: int,
                       fixed: tuple[str, ...] = ()) -> Iterator[tuple[DirectiveSet, str, dict]]:
    """Up to `tries` random sets (every dimension drawn from the template's values, those in `fixed`
    left at the seed's), the ones the template accepts, rendered: (set, program text, its CONFIG);
    each text parses and its header names the set."""
    values = template.dimension_values(world)
    rng = random.Random(seed)
    for _ in range(tries):
        ds = template.seed_directives().with_(**{d: rng.choice(v) for d, v in values.items() if d not in fixed})
        if template.check(ds, world):
            continue
        text = template.render(ds, shape, world)
        parse_program(text)
        assert directives_of(text) == ds
        yield ds, text, load_program(text).CONFIG
