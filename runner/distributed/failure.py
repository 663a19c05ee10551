"""How a rank's failure reaches the other ranks when no collective can carry it.

This module owns :class:`RankError` and the failure notes ranks leave in the run's rendezvous
store (the ``TCPStore`` that ``torchrun``'s agent, or rank 0, hosts; out of band of every
process group), used by :meth:`~speccal.runner.distributed.comm.Comm.agree`:

- a rank whose phase failed writes a note ``fail/RANK`` (phase, error type, message, exit code
  and a world-wide ``order``, the store's counter: the first note is the root cause), then
  waits up to ``Topology.failure_grace_s`` for every other rank to reach the same error
  barrier (``arrive/SEQ/RANK``);
- if they all arrive, the failure is exchanged by the barrier's gather as before and raised on
  every rank (``RankError.agreed``); the note is removed;
- if not, some peer is still inside the phase, possibly blocked in a collective this rank will
  never join: the rank marks ``left/RANK``, leaves the process group (which fails the peers'
  pending gloo collectives at once) and raises ``RankError`` with ``agreed`` false;
- a rank whose collective broke (a peer left), or that sees a peer's ``left`` mark while
  waiting, reads every note and raises them, root cause first.

Keys live under ``speccal/<comm id>/`` so that several ``Comm`` over one world never read each
other's notes. NCCL collectives already running on a device are not released by a peer leaving;
under ``torchrun`` the agent stops every rank once one exits non-zero (the CLI exits as soon as
it has left), and the group's ``timeout_s`` bounds it otherwise.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from speccal.base.errors import SpeccalError

T = TypeVar("T")

#: How long a failed rank polls the store between checks for its peers, in seconds.
POLL_S = 0.01


@dataclass(frozen=True)
class Failure:
    """One rank's failed phase, as every rank reports it."""

    rank: int
    kind: str  # the exception's type name
    message: str
    exit_code: int
    phase: str = ""
    order: int = 0  # the store's counter when it was noted (0: exchanged by a collective)

    @classmethod
    def of(cls, rank: int, phase: str, exc: BaseException) -> Failure:
        return cls(rank, type(exc).__name__, str(exc), int(getattr(exc, "exit_code", 1)), phase)

    def describe(self, phase: str, brief: bool = False) -> str:
        """``rank R: Type: message``; ``brief``: the message's first sentence, without a
        backend's ``[file:line]`` prefix (a rank's collective that broke when a peer left)."""
        where = "" if self.phase in ("", phase) else f" (in {self.phase})"
        msg = self.message
        if brief:
            msg = re.sub(r"^\[[^\]]*\]\s*", "", msg).split("\n")[0].split(". ")[0]
        return f"rank {self.rank}{where}: {self.kind}: {msg}"


class RankError(SpeccalError):
    """One or more ranks failed a phase; the message names each rank and its error.

    ``exit_code`` is the largest of the failing ranks' (2 when every failure was bad input).
    ``agreed``: every rank of the group raised this error together (the barrier's gather
    carried it); otherwise this rank left the group after it (a peer was still inside the
    phase) and ``failures`` are the notes read from the store, the root cause first.
    """

    def __init__(self, phase: str, failures: list[Failure], *, agreed: bool = True):
        self.phase = phase
        self.failures = failures
        self.agreed = agreed
        self.exit_code = max(f.exit_code for f in failures)
        parts = "; ".join(f.describe(phase, brief=not agreed and i > 0)
                          for i, f in enumerate(failures))
        if agreed:
            msg = f"{phase} failed on {len(failures)} rank(s): {parts}"
        else:
            msg = (f"{phase} failed on {len(failures)} rank(s), first on rank "
                   f"{failures[0].rank}: {parts} (not every rank reached the error barrier: "
                   "the ranks left the process group)")
        super().__init__(msg)

    @property
    def first_rank(self) -> int:
        return self.failures[0].rank


class Notes:
    """The failure notes and barrier marks of one ``Comm`` in the rendezvous store.

    ``store`` is the raw store (keys are prefixed here); ``world_size`` and ``rank`` this
    rank's place in the world. A store that stops answering (its host process died) makes
    every method fall back to what a rank knows alone: nothing noted, nobody arrived.
    """

    def __init__(self, store: Any, comm_id: str, rank: int, world_size: int):
        self.store = store
        self.prefix = f"speccal/{comm_id}/"
        self.rank = rank
        self.others = [r for r in range(world_size) if r != rank]
        self.world_size = world_size

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def post(self, failure: Failure) -> None:
        """Note this rank's failure, numbered in the order ranks noted theirs."""
        def note():
            order = self.store.add(self._key("order"), 1)
            doc = {"kind": failure.kind, "message": failure.message,
                   "exit_code": failure.exit_code, "phase": failure.phase, "order": order}
            self.store.set(self._key("fail", self.rank), json.dumps(doc))
        _quietly(note)

    def withdraw(self) -> None:
        """Remove this rank's note (its failure was exchanged by a collective)."""
        _quietly(lambda: self.store.delete_key(self._key("fail", self.rank)))

    def arrive(self, seq: int) -> None:
        _quietly(lambda: self.store.set(self._key("arrive", seq, self.rank), "1"))

    def leave(self) -> None:
        _quietly(lambda: self.store.set(self._key("left", self.rank), "1"))

    def _has(self, *parts: object) -> bool:
        return self.store.check([self._key(*parts)])

    def wait_arrivals(self, seq: int, grace_s: float) -> bool:
        """Whether every other rank reached barrier ``seq`` within ``grace_s`` seconds (False
        at once when one of them has left the group: it will never arrive)."""
        keys = [self._key("arrive", seq, r) for r in self.others]
        deadline = time.monotonic() + grace_s

        def poll() -> bool:
            while True:
                if not keys or self.store.check(keys):
                    return True
                if any(self._has("left", r) for r in self.others):
                    return False
                if time.monotonic() >= deadline:
                    return False
                time.sleep(POLL_S)

        return bool(_quietly(poll, False))

    def read(self) -> list[Failure]:
        """Every rank's note, the first noted first."""
        def notes() -> list[Failure]:
            out = []
            for r in range(self.world_size):
                if self._has("fail", r):
                    doc = json.loads(self.store.get(self._key("fail", r)))
                    out.append(Failure(r, doc["kind"], doc["message"], int(doc["exit_code"]),
                                       doc["phase"], int(doc["order"])))
            return sorted(out, key=lambda f: f.order)

        return _quietly(notes, [])


def _quietly(fn: Callable[[], T], default: T | None = None) -> T | None:
    """``fn()``, or ``default`` when the store fails (a failure is being reported already:
    an unreachable store must not replace it with its own error)."""
    try:
        return fn()
    except (RuntimeError, OSError, ValueError):  # DistStoreError is a RuntimeError
        return default
