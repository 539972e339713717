"""Which queue to try first: Sidekiq's strict, weighted and random orders."""

from __future__ import annotations

import random

from .errors import ConfigError


def parse_queue(spec: str) -> tuple[str, int]:
    """'name' or 'name,weight' as `--queue` takes it."""
    name, _, weight = spec.partition(",")
    name = name.strip()
    if not name or "\n" in name:
        raise ConfigError(f"--queue {spec!r}: a queue needs a name, e.g. --queue critical,3")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # bytes from a non-UTF-8 locale: no Redis key can be made of it
        raise ConfigError(f"--queue {spec!r}: the name is not valid UTF-8") from None
    if not weight:
        return name, 0
    try:
        w = int(weight)
    except ValueError:
        w = -1
    if w < 1:
        raise ConfigError(f"--queue {spec!r}: the weight must be a whole number >= 1")
    return name, w


class QueueOrder:
    """Gives the queue names in the order one fetch should try them.

    No weights: strict order as given. Every weight 1: a fresh random order each fetch.
    Otherwise weighted random: a queue of weight 3 leads three times as often as weight 1.
    """

    def __init__(self, specs: list[tuple[str, int]]) -> None:
        names: list[str] = []
        for name, _ in specs:
            if name not in names:
                names.append(name)
        self.names = names
        # the names a fetch may try: all of them, less the paused ones (set_paused)
        self.active = names
        self.paused: frozenset[str] = frozenset()
        weights = [w for _, w in specs]
        self.weights = {name: max(w, 1) for name, w in specs}
        if not any(weights):
            self.mode = "strict"
        elif all(w == 1 for w in weights):
            self.mode = "random"
        else:
            self.mode = "weighted"

    def set_paused(self, paused: frozenset[str]) -> None:
        """Leave out the queues in `paused` from now on (one list swap: fetches running on
        other threads see the old list or the new one, whole)."""
        self.paused = paused
        self.active = [n for n in self.names if n not in paused] if paused else self.names

    def __call__(self) -> list[str]:
        active = self.active
        if self.mode == "strict" or len(active) <= 1:
            return active
        if self.mode == "random":
            order = active[:]
            random.shuffle(order)
            return order
        # weighted order without replacement (Efraimidis-Spirakis): the same distribution
        # as shuffling a pool with each name `weight` times, without building that pool
        keys = {name: random.random() ** (1.0 / self.weights[name]) for name in active}
        return sorted(active, key=keys.__getitem__, reverse=True)
