"""vLLM's prefill speed as this replica measures it: a least-squares fit over its own timed steps.

kvengine calibrates its prefill model with a few prefills at start-up (connector/calibrate.py);
a connector inside vLLM cannot run prefills of its own before vLLM serves. Instead the worker
times every step it is part of (from the metadata's bind, before the forward, to ``wait_for_save``
after it) and reports, with the step, what it fed: (tokens fed, tokens already computed) per
request. The scheduler fits the same model the cost model uses,
``t = a + sum over requests of (b*n + c*n*(ctx + n/2))`` (cost_model.PrefillModel), over the last
``window`` prefill steps, and refits as steps arrive, so the fit follows the machine's load and
vLLM's own kernels, never a constant. Steps feeding fewer than ``MIN_OBSERVED_TOKENS`` tokens are
decode steps, another regime, and are not used.

Until ``min_samples`` prefill steps of at least two distinct sizes have been seen there is no fit
(``model`` is None): the connector then loads what the daemon holds (outcome "uncalibrated"),
which also measures the tiers' bandwidth for the day the fit arrives.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from connector.cost_model import MIN_OBSERVED_TOKENS, PrefillModel

Seqs = Sequence[tuple[int, int]]


def _features(seqs: Seqs) -> tuple[float, float, float]:
    fed = [(n, c) for n, c in seqs if n > 0]
    return 1.0, float(sum(n for n, _ in fed)), float(sum(n * (c + n / 2) for n, c in fed))


class PrefillCalibrator:
    def __init__(self, min_samples: int = 4, window: int = 64) -> None:
        self.min_samples = min_samples
        self._samples: deque[tuple[tuple[float, float, float], float]] = deque(maxlen=window)
        self._model: PrefillModel | None = None
        self._lock = threading.Lock()
        self.observed = 0

    def observe(self, seqs: Seqs, seconds: float) -> bool:
        """Fold one timed step in; False if it was not a prefill step (or not timed)."""
        if seconds <= 0 or sum(n for n, _ in seqs if n > 0) < MIN_OBSERVED_TOKENS:
            return False
        with self._lock:
            self._samples.append((_features(seqs), seconds))
            self.observed += 1
            self._model = self._fit()
        return True

    @property
    def model(self) -> PrefillModel | None:
        with self._lock:
            return self._model

    def _fit(self) -> PrefillModel | None:
        if len(self._samples) < max(self.min_samples, 2):
            return None
        x = np.array([f for f, _ in self._samples])
        y = np.array([t for _, t in self._samples])
        if len(set(x[:, 1])) < 2:  # one size only: the slope is not identified
            return None
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            neg = [active[i] for i, v in enumerate(sol) if v < 0]
            if not neg:
                coef[:] = 0
                coef[active] = sol
                break
            active = [i for i in active if i not in neg]
        if coef[1] <= 0 and coef[2] <= 0:  # a fit in which tokens cost nothing measures nothing
            return None
        return PrefillModel(float(coef[0]), float(coef[1]), float(coef[2]), observed=len(self._samples))
