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
naming the rank instead of leaving rank 0 waiting in a collective.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from speccal.base.errors import InputError, SpeccalError, UnsupportedError

T = TypeVar("T")

BACKENDS = ("gloo", "nccl")
#: What ``torchrun`` sets and :func:`init_comm` needs.
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 600.0


class RankError(SpeccalError):
    """One or more ranks failed a phase; the message names each rank and its error.

    ``exit_code`` is the largest of the failing ranks' (2 when every failure was bad input).
    """

    def __init__(self, phase: str, failures: list[tuple[int, str, str, int]]):
        self.phase = phase
        self.failures = failures  # (rank, error type, message, exit code)
        self.exit_code = max(code for *_, code in failures)
        parts = [f"rank {r}: {kind}: {msg}" for r, kind, msg, _ in failures]
        super().__init__(f"{phase} failed on {len(failures)} rank(s): " + "; ".join(parts))


@dataclass(frozen=True)
class Topology:
    """Tensor- and data-parallel sizes of a run.

    Attributes
    ----------
    tp : tensor-parallel ranks per model replica (heads, MLP columns and vocabulary sharded).
    dp : data-parallel replicas (each its own batch and Engine).
    backend : ``gloo`` or ``nccl``; None picks by device (:func:`backend_for`).
    timeout_s : collective timeout; a rank stuck this long in a collective fails.
    """

    tp: int = 1
    dp: int = 1
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(name, v, "an integer >= 1")
        if self.backend is not None and self.backend not in BACKENDS:
            raise InputError("backend", self.backend, f"one of {', '.join(BACKENDS)}")
        if not self.timeout_s > 0:
            raise InputError("timeout_s", self.timeout_s, "a positive number of seconds")

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
    which every rank must call in the same order: it creates the subgroups).
    """

    def __init__(self, topology: Topology, rank: int, local_rank: int, tp_group, dp_group,
                 host_group, backend: str):
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

    @classmethod
    def create(cls, topology: Topology, local_rank: int | None = None) -> Comm:
        """Lay ``topology`` over the initialised default group (collective: every rank calls)."""
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
        return cls(topology, rank, rank if local_rank is None else local_rank, tp_group,
                   dp_group, host, backend)

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
        """
        try:
            value, failure = fn(), None
        except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised below
            value = None
            failure = (type(exc).__name__, str(exc), getattr(exc, "exit_code", 1))
            own = exc
        else:
            own = None
        seen = self.all_gather_object(failure)
        failures = [(r, *f) for r, f in enumerate(seen) if f is not None]
        if failures:
            raise RankError(phase, failures) from own
        return value

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
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            rank=rank, world_size=world, timeout=_dt.timedelta(seconds=topology.timeout_s))
    return Comm.create(topology, local_rank)


def rank_device(device: str, comm: Comm) -> str:
    """The device this rank runs on: ``cuda`` becomes ``cuda:LOCAL_RANK`` (one GPU per rank);
    an explicit index or ``cpu`` is kept."""
    return f"cuda:{comm.local_rank}" if device == "cuda" else device
