"""Several models in one run, chosen by a bandit on improvement per dollar.

UCB1: each model's mean reward (fitness gain per dollar) plus an exploration bonus that shrinks
with the model's pulls. Rewards per dollar have no natural scale (a free local model's reward is
its gain over the cost floor), so means are divided by the largest single reward seen, which
keeps them in [0, 1] where UCB1's bonus is calibrated.
"""

from __future__ import annotations

import math
import random

from commweave.llm.client import LLMClient

#: a call's cost counts as at least this many dollars, so a free model's reward stays finite
COST_FLOOR_USD = 1e-4


class ModelPool:
    """Several models in one run, chosen by a bandit on improvement per dollar (UCB1 on
    reward = max(0, fitness gain) / max(cost, floor); unseen models first, in the given order;
    ties broken by a generator seeded with `seed`)."""

    def __init__(self, clients: list[LLMClient], seed: int = 0):
        if not clients:
            raise ValueError("a ModelPool needs at least one model")
        names = [c.name for c in clients]
        if len(set(names)) != len(names):
            raise ValueError(f"model names in a pool must be distinct, got {names}")
        self.clients = list(clients)
        self._rng = random.Random(seed)
        self._pulls = {n: 0 for n in names}  # times chosen (a proposal in flight counts)
        self._rewards = {n: 0 for n in names}  # times rewarded
        self._reward_sum = {n: 0.0 for n in names}
        self._spent = {n: 0.0 for n in names}
        self._max_reward = 0.0

    def choose(self) -> LLMClient:
        for client in self.clients:
            if self._pulls[client.name] == 0:
                return self._pull(client)
        total = sum(self._pulls.values())
        scale = self._max_reward or 1.0
        scores = [self._mean(c.name) / scale + math.sqrt(2 * math.log(total) / self._pulls[c.name])
                  for c in self.clients]
        best = max(scores)
        return self._pull(self._rng.choice([c for c, s in zip(self.clients, scores) if s >= best - 1e-12]))

    def reward(self, name: str, improvement: float, cost_usd: float) -> None:
        """What a proposal from `name` earned: its fitness gain over the parent and what it cost."""
        if name not in self._pulls:
            raise ValueError(f"model {name!r} is not in the pool ({', '.join(self._pulls)})")
        r = max(0.0, improvement) / max(cost_usd, COST_FLOOR_USD)
        self._rewards[name] += 1
        self._reward_sum[name] += r
        self._spent[name] += cost_usd
        self._pulls[name] = max(self._pulls[name], self._rewards[name])  # rewards for calls made elsewhere
        self._max_reward = max(self._max_reward, r)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per model: pulls, rewards received, mean reward (gain per dollar), dollars spent."""
        return {n: {"pulls": float(self._pulls[n]), "rewards": float(self._rewards[n]),
                    "mean_reward": self._mean(n), "spent_usd": self._spent[n]} for n in self._pulls}

    def _mean(self, name: str) -> float:
        return self._reward_sum[name] / self._rewards[name] if self._rewards[name] else 0.0

    def _pull(self, client: LLMClient) -> LLMClient:
        self._pulls[client.name] += 1
        return client
