"""The seed plan: every seed of an audit derived from the one the user gives.

Each stream has its own offset inside a stride of 1000 per master seed, so two audits
with different seeds never share a stream and the streams of one audit never collide
(the values are recorded in ``audit.json``'s ``seeds`` and must not change).
"""

from __future__ import annotations

from dataclasses import dataclass

STRIDE = 1000  # master seed -> its block of derived seeds
BOOTSTRAP_OFFSET = 7  # the paired bootstrap's resample stream
DRAW_OFFSET = 17  # + k: the random draws (derangement, permutations) of repeat k
ORDER_OFFSET = 500  # --target-ci: the pool's audit order


@dataclass(frozen=True)
class SeedPlan:
    """The user's ``seed`` and the ``repeats`` of each random condition."""

    master: int
    repeats: int = 1

    def draw(self, repeat: int) -> int:
        """The seed of repeat ``repeat``'s random draws."""
        return self.master * STRIDE + DRAW_OFFSET + repeat

    @property
    def draws(self) -> list[int]:
        return [self.draw(k) for k in range(self.repeats)]

    @property
    def bootstrap(self) -> int:
        return self.master * STRIDE + BOOTSTRAP_OFFSET

    @property
    def order(self) -> int:
        return self.master * STRIDE + ORDER_OFFSET

    @property
    def interventions(self) -> int:
        """The master of user interventions' generators (mixed with name, repeat, batch)."""
        return self.master

    @property
    def dense_twin(self) -> int:
        """The seed of a dense counterpart's fresh weights."""
        return self.master

    @property
    def timing(self) -> int:
        """The seed of the latency ratio's bootstrap."""
        return self.master
