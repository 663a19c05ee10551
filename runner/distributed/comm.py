"""Process groups of a tensor- x data-parallel run, and the host-side exchanges between ranks.

This module owns :class:`Topology` (the frozen, validated ``tp`` x ``dp`` layout), :class:`Comm`
(this rank's place in it: world rank, TP group, DP group) and :func:`init_comm`, which joins the
processes ``torchrun`` started (``env://``; the environment is read by the caller, the CLI, and
passed in as a mapping). Rank layout (Megatron's): TP innermost, so world rank
``r = dp_rank * tp + tp_rank``; the ``tp`` ranks of one data-parallel replica form one TP group.

Backend: ``nccl`` for CUDA devices, ``gloo`` for CPU (:func:`backend_for`). Host-side exchanges
(``all_gather_object``, ``broadcast_object``) go through a gloo group either way, so metadata
never lands on a device stream. :meth:`Comm.agree` is the error barrier: each rank runs a phase,
then every rank learns which ranks failed and why, so an error on rank 1 surfaces on rank 0
naming the rank instead of leaving rank 0 waiting in a collective. A rank that fails while a
peer is still inside the phase (blocked in a collective with it) does not wait for that peer:
after ``Topology.failure_grace_s`` it leaves the group, which fails the peer's collective, and
the peer reads the failure from the rendezvous store (``speccal.runner.distributed.failure``).
"""

from __future__ import annotations

import datetime as _dt
import gc
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from speccal.base.errors import InputError, SpeccalError, UnsupportedError
from speccal.runner.distributed.failure import Failure, Notes, RankError

__all__ = ["Comm", "RankError", "Topology", "backend_for", "check_world", "init_comm",
           "rank_device", "rank_env"]

T = TypeVar("T")

BACKENDS = ("gloo", "nccl")
#: What ``torchrun`` sets and :func:`init_comm` needs.
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_FAILURE_GRACE_S = 5.0


@dataclass(frozen=True)
class Topology:
    """Tensor- and data-parallel sizes of a run.

    Attributes
    ----------
    tp : tensor-parallel ranks per model replica (heads, MLP columns and vocabulary sharded).
    dp : data-parallel replicas (each its own batch and Engine).
    backend : ``gloo`` or ``nccl``; None picks by device (:func:`backend_for`).
    timeout_s : collective timeout; a rank stuck this long in a collective fails.
    failure_grace_s : how long a rank whose phase failed waits for the other ranks at the
        error barrier before it leaves the group (a peer that has not arrived by then is
        inside the phase, maybe in a collective this rank will never join).
    """

    tp: int = 1
    dp: int = 1
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    failure_grace_s: float = DEFAULT_FAILURE_GRACE_S

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(name, v, "an integer >= 1")
        if self.backend is not None and self.backend not in BACKENDS:
            raise InputError("backend", self.backend, f"one of {', '.join(BACKENDS)}")
        for name in ("timeout_s", "failure_grace_s"):
            if not getattr(self, name) > 0:
                raise InputError(name, getattr(self, name), "a positive number of seconds")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def to_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "dp": self.dp, "world_size": self.world_size}


def backend_for(device: str) -> str:
    """``nccl`` for ``cuda[:N]`` devices, ``gloo`` for everything else this runner serves."""
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from a ``torchrun`` environment, validated.

    Raises
    ------
    InputError
        A missing or non-integer variable, naming it and how to launch.
    """
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = env.get(name)
        if raw is None and name == "LOCAL_RANK":
            raw = env.get("RANK")
        if raw is None:
            raise InputError(
                f"environment variable {name}", None,
                "set by torchrun: launch with torchrun --nproc-per-node N -m speccal ...")
        try:
            values[name] = int(raw)
        except ValueError:
            raise InputError(f"environment variable {name}", raw, "an integer") from None
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise InputError(
                f"environment variable {name}", None,
                "set by torchrun: launch with torchrun --nproc-per-node N -m speccal ...")
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if world < 1 or not 0 <= rank < world:
        raise InputError("environment variable RANK", rank, f"an integer in [0, {world})")
    return rank, world, values["LOCAL_RANK"]


class Comm:
    """This rank's view of a running process group laid out by ``topology``.

    Built by :func:`init_comm` (or :meth:`create` over an already initialised default group,
    which every rank must call in the same order: it creates the subgroups). ``notes``: the
    failure notes in the rendezvous store (None: failures are exchanged by collectives only).
    """

    def __init__(self, topology: Topology, rank: int, local_rank: int, tp_group, dp_group,
                 host_group, backend: str, notes: Notes | None = None):
        self.topology = topology
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = topology.world_size
        self.tp_size = topology.tp
        self.dp_size = topology.dp
        self.tp_rank = rank % topology.tp
        self.dp_rank = rank // topology.tp
        self.tp_group = tp_group
        self.dp_group = dp_group
        self.host_group = host_group
        self.backend = backend
        self.notes = notes
        self.left: str | None = None  # why this rank left the group (then nothing runs)
        self._seq = 0  # error barriers passed: the same count on every rank

    @classmethod
    def create(cls, topology: Topology, local_rank: int | None = None, store=None) -> Comm:
        """Lay ``topology`` over the initialised default group (collective: every rank calls).

        ``store``: the run's rendezvous store, for failure notes (:func:`init_comm` passes it;
        None: the default group's)."""
        if not dist.is_initialized():
            raise UnsupportedError("Comm.create needs an initialised torch.distributed group "
                                   "(init_comm joins the processes torchrun started)")
        world, rank = dist.get_world_size(), dist.get_rank()
        check_world(topology, world)
        tp, dp = topology.tp, topology.dp
        timeout = _dt.timedelta(seconds=topology.timeout_s)
        backend = dist.get_backend()
        tp_group = dp_group = None
        for d in range(dp):  # every rank creates every group, in the same order
            g = dist.new_group([d * tp + t for t in range(tp)], timeout=timeout)
            if rank // tp == d:
                tp_group = g
        for t in range(tp):
            g = dist.new_group([d * tp + t for d in range(dp)], timeout=timeout)
            if rank % tp == t:
                dp_group = g
        host = (dist.group.WORLD if backend == "gloo"
                else dist.new_group(list(range(world)), backend="gloo", timeout=timeout))
        box = [uuid.uuid4().hex[:12] if rank == 0 else None]  # this Comm's keys in the store
        dist.broadcast_object_list(box, src=0, group=host)
        if store is None:
            store = _default_store()
        notes = None if store is None else Notes(store, box[0], rank, world)
        return cls(topology, rank, rank if local_rank is None else local_rank, tp_group,
                   dp_group, host, backend, notes)

    # ------------------------------------------------------------------ tensor collectives

    def all_reduce_tp(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``x`` over this rank's TP group (returned); TP=1: ``x``."""
        if self.tp_size == 1:
            return x
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        dist.all_reduce(x, op=ops[op], group=self.tp_group)
        return x

    def all_gather_tp(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's ``x`` along ``dim`` in rank order; TP=1: ``x``."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    # ------------------------------------------------------------------ host-side exchanges

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in world-rank order (host side, gloo)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of world rank ``src`` on every rank (host side, gloo)."""
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.host_group)
        return box[0]

    def agree(self, phase: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this rank, then exchange success or failure with every rank.

        Returns ``fn()``'s value when every rank succeeded; otherwise raises :class:`RankError`
        on every rank, naming each failing rank, its error type and message (a rank whose own
        call succeeded raises it too, so all ranks leave the phase together).

        A failed rank waits at most ``failure_grace_s`` for the others; if one has not arrived
        it is inside the phase (maybe in a collective with this rank), so this rank leaves the
        group and raises ``RankError(agreed=False)``; the peer's collective then fails, and it
        raises the failures noted in the store, root cause first (module
        ``speccal.runner.distributed.failure``). A ``RankError`` raised inside ``fn`` passes
        through unchanged: it is already every rank's, or this rank has left. After leaving,
        every call raises.
        """
        self._check_joined(phase)
        self._seq += 1
        seq, notes = self._seq, self.notes
        own: Exception | None = None
        try:
            value, failure = fn(), None
        except RankError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised below
            value, own = None, exc
            failure = Failure.of(self.rank, phase, exc)
            if notes is not None:
                notes.post(failure)
        if notes is not None:
            notes.arrive(seq)  # before waiting: ranks failing together find each other here
            if failure is not None and not notes.wait_arrivals(
                    seq, self.topology.failure_grace_s):
                self._leave_after(phase, failure, own)
        try:
            seen = self.all_gather_object(failure)
        except Exception as exc:  # noqa: BLE001 - a peer left the group: its note says why
            self._leave_after(phase, failure or Failure.of(self.rank, phase, exc), own or exc,
                              exc)
        failures = [Failure(r, f.kind, f.message, f.exit_code) for r, f in enumerate(seen)
                    if f is not None]
        if failures:
            if notes is not None and failure is not None:
                notes.withdraw()
            raise RankError(phase, failures) from own
        return value

    def _leave_after(self, phase: str, failure: Failure, cause: BaseException,
                     *handled: BaseException):
        """Leave the group after this rank's ``failure`` (raised as ``cause``) and raise every
        noted failure."""
        notes = self.notes
        seen = notes.read() if notes is not None else []
        if not any(f.rank == self.rank for f in seen):
            if notes is not None:  # a broken collective: the ranks after this one read it too
                notes.post(failure)
            seen.append(failure)
        if notes is not None:
            notes.leave()
        for exc in (cause, *handled):  # their frames may hold a group: it must go to close
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
        self.leave(f"{phase} failed")
        raise RankError(phase, seen, agreed=False) from cause

    def leave(self, why: str = "left") -> None:
        """Leave the process group now: destroy it and drop this rank's references to its
        groups, so that gloo closes the connections and a peer blocked in a collective with
        this rank fails at once instead of at ``timeout_s``. Every later call raises."""
        if self.left is not None:
            return
        self.left = why
        self.tp_group = self.dp_group = self.host_group = None
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # a group's connections close when its last reference goes

    def _check_joined(self, phase: str) -> None:
        if self.left is not None:
            raise SpeccalError(f"{phase}: this rank has left the process group ({self.left})")

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)


def check_world(topology: Topology, world_size: int) -> None:
    """Refuse a world size other than ``tp * dp``."""
    if world_size != topology.world_size:
        raise InputError(
            "world size (torchrun --nproc-per-node x nodes)", world_size,
            f"tp * dp = {topology.tp} * {topology.dp} = {topology.world_size}")


def init_comm(topology: Topology, env: Mapping[str, str], device: str = "cpu") -> Comm:
    """Join the process group ``torchrun`` started and lay ``topology`` over it.

    ``env`` is the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``), read by the caller. ``device`` picks the backend
    (``topology.backend`` overrides). Idempotent over an already initialised default group.

    Raises
    ------
    InputError
        Missing environment, or a world size other than ``tp * dp`` (checked before joining).
    """
    rank, world, local_rank = rank_env(env)
    check_world(topology, world)
    backend = topology.backend or backend_for(device)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise UnsupportedError("backend 'nccl' needs CUDA devices; use gloo on cpu")
        torch.cuda.set_device(local_rank)  # NCCL collectives run on the current device
    store = None
    if not dist.is_initialized():
        # the rendezvous as init_process_group's tcp:// method makes it (the agent's store
        # under torchrun), kept for failure notes (speccal.runner.distributed.failure)
        timeout = _dt.timedelta(seconds=topology.timeout_s)
        store, _, _ = next(dist.rendezvous(
            f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}", rank, world, timeout=timeout))
        store.set_timeout(timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store),
                                rank=rank, world_size=world, timeout=timeout)
    return Comm.create(topology, local_rank, store)


def rank_device(device: str, comm: Comm) -> str:
    """The device this rank runs on: ``cuda`` becomes ``cuda:LOCAL_RANK`` (one GPU per rank);
    an explicit index or ``cpu`` is kept."""
    return f"cuda:{comm.local_rank}" if device == "cuda" else device


def _default_store():
    """The default group's store (a group initialised elsewhere), or None if torch hides it."""
    try:
        return dist.distributed_c10d._get_default_store()  # private, hence the fallback
    except (AttributeError, RuntimeError, ValueError):
        return None
