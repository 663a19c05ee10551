"""Speculative decoding statistics: per round and accumulated over an engine's life.

This module owns :class:`SpecStats`: drafted and accepted tokens, per-position drafted/accepted
counts (``accepted_at[j]``: rounds whose draft position ``j`` was accepted, i.e. the first
``j + 1`` positions), and the accepted-length histogram ``hist[a]`` (rounds of one request that
accepted ``a`` drafts). Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecStats:
    draft_width: int
    num_rounds: int = 0  # request-rounds (one request in one round)
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    drafted_at: np.ndarray = field(default=None)  # [w] int64
    accepted_at: np.ndarray = field(default=None)  # [w] int64
    hist: np.ndarray = field(default=None)  # [w + 1] int64

    def __post_init__(self) -> None:
        w = self.draft_width
        self.drafted_at = np.zeros(w, np.int64) if self.drafted_at is None else self.drafted_at
        self.accepted_at = np.zeros(w, np.int64) if self.accepted_at is None else self.accepted_at
        self.hist = np.zeros(w + 1, np.int64) if self.hist is None else self.hist

    def add(self, num_verify: np.ndarray, accepted: np.ndarray, num_emitted: int) -> None:
        """Record one round: ``num_verify [B]`` drafts verified, ``accepted [B]`` accepted."""
        w = self.draft_width
        pos = np.arange(w)
        self.num_rounds += len(accepted)
        self.num_drafted += int(num_verify.sum())
        self.num_accepted += int(accepted.sum())
        self.num_emitted += num_emitted
        self.drafted_at += (pos[None, :] < num_verify[:, None]).sum(0)
        self.accepted_at += (pos[None, :] < accepted[:, None]).sum(0)
        self.hist += np.bincount(accepted, minlength=w + 1)[: w + 1]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted / self.num_rounds if self.num_rounds else float("nan")

    def prefix_acceptance(self) -> np.ndarray:
        """``p_j``: fraction of request-rounds whose first ``j + 1`` drafts were all accepted."""
        return self.accepted_at / max(self.num_rounds, 1)

    def to_dict(self) -> dict:
        return {
            "rounds": self.num_rounds,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_at": self.accepted_at.tolist(),
            "drafted_at": self.drafted_at.tolist(),
            "accepted_length_hist": self.hist.tolist(),
        }
