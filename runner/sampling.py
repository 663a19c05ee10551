"""Token sampling and speculative acceptance for the embedded runner.

This module owns the per-request sampling options (:class:`SamplingParams`, validated on
construction), the refusal of options the runner does not implement (:func:`check_supported`),
the one target filter shared by the plain sampler and the rejection sampler
(:func:`filtered_probs`), the plain sampler (:func:`sample_plain`), the four acceptance modes of
a speculative round (``greedy``, ``sample``, ``synthetic``, ``forced``: the ``verify_*``
functions) and the draft-probability score used by adaptive verification
(:func:`draft_token_probability`). The greedy fast path: :func:`batch_is_greedy` (the host's
per-batch choice) and the ``verify_*_tokens`` twins of the argmax-only acceptance modes, which take
the target's argmax tokens ``[B, k + 1]`` instead of its logits grid.

Data layout of a verification (``B`` requests, ``k`` drafted tokens each, vocabulary ``V``):

- ``draft_tokens``  ``[B, k]`` integer: the greedy draft's tokens.
- ``target_logits`` ``[B, k + 1, V]``: row ``j`` of request ``b`` is the target's distribution for
  the token after the prompt plus ``j`` accepted drafts; row ``k`` gives the bonus token.
- ``num_verify``    ``[B]`` integer, optional: request ``b`` verifies only its first
  ``num_verify[b]`` drafts (a trimmed verify; rows past it are ignored). Values are clamped to
  ``[0, k]``; the default is ``k`` for every request.
- results: ``num_accepted`` ``[B]`` int64 and ``out_tokens`` ``[B, k + 1]`` int64.
  ``out_tokens[b, :num_accepted[b] + 1]`` are emitted (the accepted drafts, then the bonus or
  replacement token taken from row ``num_accepted[b]``); positions past that are ``-1``.
- per-request sampling tensors ``temperature``, ``top_k``, ``top_p``, ``min_p`` are ``[B]`` (one
  value per request; :func:`sampling_tensors` builds them from :class:`SamplingParams`).

Filter order (vLLM v1's sampler, which xLLM's "normal sampler semantics" follow): temperature,
then min-p on the tempered probabilities over the full vocabulary (keep ``p >= min_p * p_max``),
then top-k (ties with the k-th value kept), then top-p on the renormalised survivors (keep the
smallest most-likely-first set whose mass reaches ``top_p``). The argmax always survives.
Temperatures below :data:`GREEDY_TEMPERATURE` mean greedy, as in vLLM: such a row's distribution
is a point mass on the argmax of its raw logits, so greedy and random requests mix in one batch.

The greedy fast path of a round (:func:`selection_kind`, decided on the host at prepare time):
when every request of the batch is greedy, plain decoding and ``sample`` verification take the
argmax of the packed target rows and gather only tokens (no temperature / filters / sort, no
``[bcap, k + 1, V]`` logits grid); the tokens equal the general path's (a greedy row's filtered
distribution is a point mass on the argmax). ``greedy`` / ``forced`` / ``synthetic``
verification emit argmax tokens whatever the batch, so they always take the token path. The
choice selects a different captured graph (the ``sampling`` field of the target ``GraphKey``).
One difference: the fast path draws no random numbers, so a later mixed batch sees another
generator state than after general-path rounds. Under tensor parallelism the argmax-only
selections reduce across the vocabulary shards instead of gathering ``[N, V]`` logits (the
draft's ``MTPHead.greedy_draft``, the target's ``greedy_tokens`` / ``argmax_partials``); only
sampling gathers the shards.

Everything is vectorised on the logits' device with no host synchronisation (no ``.item()``,
``.tolist()``, ``nonzero()`` or Python branch on tensor values), so a round can be captured in a
CUDA graph. Randomness comes only from the ``generator`` argument (``torch.rand`` and exponential
races); a non-default CUDA generator must be registered with the graph being captured
(``torch.cuda.CUDAGraph.register_generator_state``). Python-level choices (a filter passed as
``None``, a ``draft_probs`` given or not) are fixed per captured shape.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speccal.base.errors import InputError, UnsupportedError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""

_PENALTY_LIMIT = 2.0  # OpenAI / vLLM range for presence and frequency penalties


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options, validated on construction.

    Parameters
    ----------
    temperature : float
        ``>= 0``; below :data:`GREEDY_TEMPERATURE` the request decodes greedily.
    top_k : int
        ``>= 0``; keep the ``top_k`` most likely tokens (ties kept). ``0`` turns it off.
    top_p : float
        In ``(0, 1]``; nucleus mass. ``1`` turns it off.
    min_p : float
        In ``[0, 1]``; keep tokens with ``p >= min_p * p_max``. ``0`` turns it off.
    max_tokens : int
        ``>= 1``; generated tokens after which the request finishes.
    stop_token_ids : tuple of int
        Extra token ids (``>= 0``) that finish the request; any iterable is stored as a tuple.
    ignore_eos : bool
        Keep generating past the model's EOS token.
    seed, presence_penalty, frequency_penalty, repetition_penalty, logprobs
        Accepted and range-checked so that a request is described faithfully, but the runner
        does not implement them: :func:`check_supported` refuses non-neutral values before
        running instead of silently ignoring them.

    Raises
    ------
    InputError
        A value of the wrong type or out of range, naming the field.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def real(name: str, ok, expected: str) -> None:
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or not ok(float(value)):
                raise InputError(name, value, expected)
            object.__setattr__(self, name, float(value))

        def integer(name: str, ok, expected: str, *, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not _is_int(value) or not ok(int(value)):
                raise InputError(name, value, expected)
            object.__setattr__(self, name, int(value))

        real("temperature", lambda v: v >= 0.0, "a finite number >= 0")
        integer("top_k", lambda v: v >= 0, "an integer >= 0 (0 = off)")
        real("top_p", lambda v: 0.0 < v <= 1.0, "a number in (0, 1] (1 = off)")
        real("min_p", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1] (0 = off)")
        integer("max_tokens", lambda v: v >= 1, "an integer >= 1")
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, set, frozenset)):
            raise InputError("stop_token_ids", stop, "a sequence of integer token ids >= 0")
        stop = tuple(stop)
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise InputError("stop_token_ids", stop, "a sequence of integer token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        if not isinstance(self.ignore_eos, bool):
            raise InputError("ignore_eos", self.ignore_eos, "a bool")
        integer("seed", lambda v: True, "None or an integer", optional=True)
        limit = f"a number in [-{_PENALTY_LIMIT}, {_PENALTY_LIMIT}] (0 = neutral)"
        real("presence_penalty", lambda v: abs(v) <= _PENALTY_LIMIT, limit)
        real("frequency_penalty", lambda v: abs(v) <= _PENALTY_LIMIT, limit)
        real("repetition_penalty", lambda v: v > 0.0, "a number > 0 (1 = neutral)")
        integer("logprobs", lambda v: v >= 0, "None or an integer >= 0", optional=True)

    @property
    def is_greedy(self) -> bool:
        """Whether this request decodes greedily (temperature below :data:`GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE


def batch_is_greedy(params: Sequence[SamplingParams]) -> bool:
    """Whether every request of a batch decodes greedily (a host decision, made at prepare time).

    True selects the runner's greedy fast path (argmax only: no filters, no sort); an empty
    batch counts as greedy.
    """
    return all(p.is_greedy for p in params)


def check_supported(params: SamplingParams) -> None:
    """Refuse, before running, the options the runner does not implement.

    Structured constraints, min-tokens stop masks and token bias have no field in
    :class:`SamplingParams`, so they cannot be requested at all.

    Raises
    ------
    UnsupportedError
        Naming every offending field, its value and why it is refused.
    """
    problems = []
    if params.seed is not None:
        problems.append(
            f"seed={params.seed!r} (per-request seeds are not supported: a round draws every "
            "request from one device generator)"
        )
    for name, neutral in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        value = getattr(params, name)
        if value != neutral:
            problems.append(f"{name}={value!r} (penalties are not supported; use {neutral})")
    if params.logprobs is not None:
        problems.append(f"logprobs={params.logprobs!r} (logprobs are not returned; use None)")
    if problems:
        raise UnsupportedError("unsupported sampling options: " + "; ".join(problems))


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack per-request options into the ``[B]`` tensors the samplers take.

    Returns
    -------
    temperature, top_k, top_p, min_p : torch.Tensor
        ``[B]`` float32, int64, float32, float32 on ``device``.
    """
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise InputError(f"params[{i}]", p, "a SamplingParams")
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p, min_p


# ---------------------------------------------------------------------------------------------
# The shared filter and the plain sampler


def _check_row_param(name: str, value: torch.Tensor | None, rows: int, *, optional: bool) -> None:
    if value is None:
        if optional:
            return
        raise InputError(name, None, f"a tensor of shape [{rows}]")
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (rows,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InputError(name, shape, f"a tensor of shape [{rows}]")


def filtered_probs(
    logits: torch.Tensor,  # [rows, V]
    temperature: torch.Tensor,  # [rows] float
    top_k: torch.Tensor | None = None,  # [rows] int, 0 = off
    top_p: torch.Tensor | None = None,  # [rows] float, 1 = off
    min_p: torch.Tensor | None = None,  # [rows] float, 0 = off
) -> torch.Tensor:  # [rows, V] float32
    """The distribution a request samples from: tempered and filtered target probabilities.

    Order: temperature, min-p (threshold ``min_p * p_max`` on the tempered probabilities), top-k
    (ties with the k-th value kept), top-p on the renormalised survivors (smallest
    most-likely-first set with mass ``>= top_p``). Greedy rows (temperature below
    :data:`GREEDY_TEMPERATURE`) are a point mass on ``argmax(logits)``. A filter passed as
    ``None`` is off for every row and costs nothing; with all three off no sort is done.

    Returns
    -------
    torch.Tensor
        ``[rows, V]`` float32 probabilities, each row summing to 1.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InputError("logits", shape, "a floating tensor of shape [rows, vocab]")
    rows = logits.shape[0]
    _check_row_param("temperature", temperature, rows, optional=False)
    _check_row_param("top_k", top_k, rows, optional=True)
    _check_row_param("top_p", top_p, rows, optional=True)
    _check_row_param("min_p", min_p, rows, optional=True)

    x = logits.float()
    is_greedy = temperature < GREEDY_TEMPERATURE  # [rows]
    # Greedy rows divide by 1 so that their (unused) probabilities stay finite.
    safe_t = torch.where(is_greedy, torch.ones_like(temperature), temperature).float()
    probs = torch.softmax(x / safe_t[:, None], dim=-1)

    if top_k is not None or top_p is not None or min_p is not None:
        # Every filter keeps a prefix of the most-likely-first order, so one sort serves all.
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [rows, V]
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if min_p is not None:
            # p / p_max is unchanged by renormalisation, so min-p commutes with top-k.
            keep &= sorted_p >= min_p.float()[:, None] * sorted_p[:, :1]
        if top_k is not None:
            vocab = sorted_p.shape[-1]
            k = top_k.long()
            kth = torch.where(k > 0, k.clamp(max=vocab) - 1, torch.full_like(k, vocab - 1))
            keep &= sorted_p >= sorted_p.gather(1, kth[:, None])
        if top_p is not None:
            kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            mass_before = kept.cumsum(dim=-1) - kept  # exclusive: 0 for the argmax
            total = kept.sum(dim=-1, keepdim=True)
            tp = top_p.float()[:, None]
            keep &= (mass_before < tp * total) | (tp >= 1.0)
        kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(1, order, kept)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    argmax = x.argmax(dim=-1)  # raw logits: the same token verify_greedy picks
    point = torch.zeros_like(probs).scatter(1, argmax[:, None], 1.0)
    return torch.where(is_greedy[:, None], point, probs)


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of ``probs`` ``[rows, V]`` by an exponential race: ``argmax p / E``.

    With ``E ~ Exp(1)`` i.i.d., ``E_i / p_i`` are exponential with rates ``p_i`` and the smallest
    one wins with probability ``p_i``. Unlike ``torch.multinomial`` this never syncs the host.
    """
    e = torch.empty_like(probs).exponential_(generator=generator)
    # Clamping keeps zero-probability tokens at score 0 (never 0 / 0 = NaN, which argmax picks).
    return (probs / e.clamp_min(torch.finfo(e.dtype).tiny)).argmax(dim=-1)


def sample_plain(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] float
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] float, 1 = off
    min_p: torch.Tensor | None,  # [B] float, 0 = off
    generator: torch.Generator | None,
) -> torch.Tensor:  # [B] int64
    """Sample one token per request with the normal sampler's semantics (see :func:`filtered_probs`).

    Greedy rows return ``argmax(logits)`` exactly.
    """
    return _race(filtered_probs(logits, temperature, top_k, top_p, min_p), generator)


# ---------------------------------------------------------------------------------------------
# Verification


def _check_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int, int]:
    if (
        not isinstance(draft_tokens, torch.Tensor)
        or draft_tokens.dim() != 2
        or (draft_tokens.is_floating_point() or draft_tokens.is_complex())
    ):
        shape = (
            tuple(draft_tokens.shape) if isinstance(draft_tokens, torch.Tensor) else draft_tokens
        )
        raise InputError("draft_tokens", shape, "an integer tensor of shape [batch, k]")
    b, k = draft_tokens.shape
    if (
        not isinstance(target_logits, torch.Tensor)
        or not target_logits.is_floating_point()
        or target_logits.dim() != 3
        or tuple(target_logits.shape[:2]) != (b, k + 1)
    ):
        shape = tuple(target_logits.shape) if isinstance(target_logits, torch.Tensor) else None
        raise InputError(
            "target_logits", shape, f"a floating tensor of shape [{b}, {k + 1}, vocab] (k + 1 rows)"
        )
    return b, k, target_logits.shape[2]


def _verify_lengths(num_verify: torch.Tensor | None, b: int, k: int, device) -> torch.Tensor:
    if num_verify is None:
        return torch.full((b,), k, dtype=torch.int64, device=device)
    if (
        not isinstance(num_verify, torch.Tensor)
        or tuple(num_verify.shape) != (b,)
        or num_verify.is_floating_point()
    ):
        shape = tuple(num_verify.shape) if isinstance(num_verify, torch.Tensor) else num_verify
        raise InputError("num_verify", shape, f"an integer tensor of shape [{b}]")
    return num_verify.to(device=device, dtype=torch.int64).clamp(0, k)


def _accepted_length(
    accept: torch.Tensor,  # [B, k] bool: position j passes its own test
    num_verify: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B] int64
    """Length of the accepted prefix: stop at the first failure or at ``num_verify``."""
    pos = torch.arange(accept.shape[1], device=accept.device)
    ok = accept & (pos[None, :] < num_verify[:, None])
    return ok.long().cumprod(dim=-1).sum(dim=-1)


def _emit(
    draft_tokens: torch.Tensor,  # [B, k]
    num_accepted: torch.Tensor,  # [B] int64
    row_tokens: torch.Tensor,  # [B, k + 1]: the bonus/replacement candidate of each row
) -> torch.Tensor:  # [B, k + 1] int64
    """Accepted drafts, then the candidate of row ``num_accepted``, then ``-1``."""
    b, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    na = num_accepted[:, None]
    drafts = draft_tokens.long()
    padded = torch.cat([drafts, drafts.new_full((b, 1), -1)], dim=1)
    last = row_tokens.long().gather(1, na)  # [B, 1]
    out = torch.where(pos < na, padded, torch.full_like(padded, -1))
    return torch.where(pos == na, last, out)


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, k] int
    target_logits: torch.Tensor,  # [B, k + 1, V]
    *,
    num_verify: torch.Tensor | None = None,  # [B] int, drafts verified per request
) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int64, [B, k + 1] int64
    """Lossless greedy verification: accept drafts while they equal the target's argmax.

    The token at row ``num_accepted`` is the target's argmax there: the correction at the first
    mismatch, or the bonus when every verified draft matched.
    """
    b, k, _ = _check_verify(draft_tokens, target_logits)
    nv = _verify_lengths(num_verify, b, k, target_logits.device)
    target = target_logits.argmax(dim=-1)  # [B, k + 1]
    num_accepted = _accepted_length(target[:, :k] == draft_tokens.long(), nv)
    return num_accepted, _emit(draft_tokens, num_accepted, target)


def verify_greedy_tokens(
    draft_tokens: torch.Tensor,  # [B, k] int
    target_tokens: torch.Tensor,  # [B, k + 1] int: the target's argmax of each verify row
    *,
    num_verify: torch.Tensor | None = None,  # [B] int, drafts verified per request
) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int64, [B, k + 1] int64
    """:func:`verify_greedy` from the target's argmax tokens instead of its logits.

    Same result as ``verify_greedy(draft_tokens, logits)`` with
    ``target_tokens = logits.argmax(-1)``; the caller can take the argmax over the packed verify
    rows and gather only the tokens (the runner's greedy fast path), never the ``[B, k + 1, V]``
    logits grid.
    """
    b, k = _check_verify_tokens(draft_tokens, target_tokens)
    nv = _verify_lengths(num_verify, b, k, target_tokens.device)
    target = target_tokens.long()
    num_accepted = _accepted_length(target[:, :k] == draft_tokens.long(), nv)
    return num_accepted, _emit(draft_tokens, num_accepted, target)


def _check_verify_tokens(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[int, int]:
    if (
        not isinstance(draft_tokens, torch.Tensor)
        or draft_tokens.dim() != 2
        or draft_tokens.is_floating_point()
    ):
        shape = tuple(draft_tokens.shape) if isinstance(draft_tokens, torch.Tensor) else None
        raise InputError("draft_tokens", shape, "an integer tensor of shape [batch, k]")
    b, k = draft_tokens.shape
    if (
        not isinstance(target_tokens, torch.Tensor)
        or tuple(target_tokens.shape) != (b, k + 1)
        or target_tokens.is_floating_point()
    ):
        shape = tuple(target_tokens.shape) if isinstance(target_tokens, torch.Tensor) else None
        raise InputError("target_tokens", shape, f"an integer tensor of shape [{b}, {k + 1}]")
    return b, k


def verify_rejection(
    draft_tokens: torch.Tensor,  # [B, k] int
    target_logits: torch.Tensor,  # [B, k + 1, V]
    temperature: torch.Tensor,  # [B] float
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] float, 1 = off
    min_p: torch.Tensor | None,  # [B] float, 0 = off
    generator: torch.Generator | None,
    *,
    draft_probs: torch.Tensor | None = None,  # [B, k, V] proposal; None = greedy point mass
    num_verify: torch.Tensor | None = None,  # [B] int, drafts verified per request
) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int64, [B, k + 1] int64
    """Rejection-sampling verification: emitted tokens follow the filtered target distribution.

    The target distribution ``p`` of each row is :func:`filtered_probs` with the request's
    options, so greedy rows (temperature 0) verify exactly like :func:`verify_greedy` within the
    same batch.

    **Greedy draft (``draft_probs=None``)**: the proposal is a point mass ``q = delta_d`` on the
    draft token ``d``. Standard speculative sampling accepts ``d`` with probability
    ``min(1, p(d) / q(d)) = p(d)`` and on rejection draws from the residual
    ``max(0, p - q) / Z``; since ``p(d) - 1 <= 0`` the residual is ``p`` restricted to tokens
    ``!= d``, renormalised. One sample ``x ~ p`` per row realises both steps exactly:
    ``P(x == d) = p(d)`` is the acceptance probability, and conditioned on ``x != d`` the sample
    is distributed as ``p`` restricted to ``!= d``, i.e. the residual. So each verify row is
    sampled independently from ``p``; drafts are accepted while ``sample == draft``; the first
    mismatching sample is the replacement; if every verified draft matched, the sample of row
    ``num_verify`` is the bonus.

    **General proposal (``draft_probs`` given)**: the drafts must have been drawn from
    ``draft_probs``. Position ``j`` is accepted when ``u * q(d) < p(d)`` with ``u ~ U[0, 1)``
    (probability ``min(1, p(d) / q(d))``); the replacement is drawn from
    ``max(0, p - q)`` renormalised, the bonus from ``p``.

    Returns
    -------
    num_accepted : torch.Tensor
        ``[B]`` int64, ``<= num_verify``.
    out_tokens : torch.Tensor
        ``[B, k + 1]`` int64, emitted tokens then ``-1``.
    """
    b, k, vocab = _check_verify(draft_tokens, target_logits)
    nv = _verify_lengths(num_verify, b, k, target_logits.device)
    # Checked here against B: filtered_probs only sees the expanded [B * (k + 1)] rows.
    _check_row_param("temperature", temperature, b, optional=False)
    _check_row_param("top_k", top_k, b, optional=True)
    _check_row_param("top_p", top_p, b, optional=True)
    _check_row_param("min_p", min_p, b, optional=True)

    def per_row(value: torch.Tensor | None) -> torch.Tensor | None:
        # Every verify row of a request uses that request's options.
        return None if value is None else value[:, None].expand(b, k + 1).reshape(-1)

    p = filtered_probs(
        target_logits.reshape(b * (k + 1), vocab),
        per_row(temperature),
        per_row(top_k),
        per_row(top_p),
        per_row(min_p),
    ).view(b, k + 1, vocab)
    drafts = draft_tokens.long()

    if draft_probs is None:
        samples = _race(p.view(-1, vocab), generator).view(b, k + 1)
        num_accepted = _accepted_length(samples[:, :k] == drafts, nv)
        return num_accepted, _emit(draft_tokens, num_accepted, samples)

    if (
        not isinstance(draft_probs, torch.Tensor)
        or tuple(draft_probs.shape) != (b, k, vocab)
        or not draft_probs.is_floating_point()
    ):
        shape = tuple(draft_probs.shape) if isinstance(draft_probs, torch.Tensor) else draft_probs
        raise InputError("draft_probs", shape, f"a floating tensor of shape [{b}, {k}, {vocab}]")
    q = draft_probs.float()
    p_draft = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # [B, k]
    q_draft = q.gather(2, drafts[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand((b, k), generator=generator, device=p.device)
    num_accepted = _accepted_length(u * q_draft < p_draft, nv)

    residual = (p[:, :k] - q).clamp_min(0.0)  # [B, k, V]
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q leaves no residual, but then a rejection has probability 0: any distribution does.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :k])
    # Rows before num_verify can only end the round by a rejection (residual); the row at
    # num_verify can only give the bonus (p).
    pos = torch.arange(k + 1, device=p.device)[None, :, None]
    dist = torch.cat([residual, p[:, k:]], dim=1)
    dist = torch.where(pos < nv[:, None, None], dist, p)
    samples = _race(dist.view(-1, vocab), generator).view(b, k + 1)
    return num_accepted, _emit(draft_tokens, num_accepted, samples)


def _profile_tensor(profile, k: int, device) -> torch.Tensor:  # -> [1, k] or [B, k]
    """The acceptance probabilities of a synthetic draw, broadcastable over ``[B, k]``: a
    profile (``[w >= k]``, one per position) or per-draft probabilities (``[B, w >= k]``, the
    scores of :func:`synthetic_draft_scores`)."""
    if isinstance(profile, torch.Tensor):
        # Values are not checked: that would read the device (the engine validates its config).
        if (profile.dim() not in (1, 2) or profile.shape[-1] < k
                or not profile.is_floating_point()):
            raise InputError(
                "profile", tuple(profile.shape),
                f"a floating tensor [w] or [B, w] with w >= k={k}",
            )
        prof = profile[..., :k].to(device=device, dtype=torch.float32)
        return prof if prof.dim() == 2 else prof[None, :]
    if isinstance(profile, (str, bytes)) or not isinstance(profile, Sequence):
        raise InputError("profile", profile, "a sequence of acceptance probabilities in [0, 1]")
    values = list(profile)
    if len(values) < k:
        raise InputError("profile", values, f"at least k={k} per-position probabilities")
    for i, v in enumerate(values):
        if not _is_real(v) or not 0.0 <= float(v) <= 1.0:
            raise InputError(f"profile[{i}]", v, "an acceptance probability in [0, 1]")
    return torch.tensor([[float(v) for v in values[:k]]], dtype=torch.float32, device=device)


def verify_synthetic(
    draft_tokens: torch.Tensor,  # [B, k] int
    target_logits: torch.Tensor,  # [B, k + 1, V]
    profile: Sequence[float] | torch.Tensor,  # [w >= k]: P(accept j | accepted 0..j-1)
    generator: torch.Generator | None,
    *,
    num_verify: torch.Tensor | None = None,  # [B] int, drafts verified per request
) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int64, [B, k + 1] int64
    """Synthetic acceptance: accepted length drawn from a per-position profile (vLLM-style).

    Position ``j`` is accepted with conditional probability ``profile[j]`` given that positions
    ``0..j-1`` were; the first rejection stops the round, so the expected accepted length is
    ``sum_j prod_{i <= j} profile[i]``. The emitted tokens are the drafts of accepted positions
    and the target's argmax at row ``num_accepted`` (replacement or bonus), so the round costs
    exactly what a real one of that acceptance costs. Inside a captured graph pass ``profile``
    as a device tensor (a sequence is copied from the host).
    """
    b, k, _ = _check_verify(draft_tokens, target_logits)
    nv = _verify_lengths(num_verify, b, k, target_logits.device)
    prof = _profile_tensor(profile, k, target_logits.device)
    u = torch.rand((b, k), generator=generator, device=target_logits.device)
    num_accepted = _accepted_length(u < prof, nv)
    return num_accepted, _emit(draft_tokens, num_accepted, target_logits.argmax(dim=-1))


def synthetic_draft_scores(
    profile: torch.Tensor,  # [w >= k]: P(accept j | accepted 0..j-1)
    informativeness: float,
    generator: torch.Generator | None,
    out: torch.Tensor,  # [B, k] float32, written in place and returned
) -> torch.Tensor:
    """The draft scores of a synthetic round, which its acceptance then uses: ``out [B, k]``.

    Each drafted position ``j`` gets ``q = p_j + lam * (Bern(p_j) - p_j)`` (``lam`` =
    ``informativeness`` in ``[0, 1]``) and is accepted, given its prefix, with probability ``q``
    (pass ``out`` as the ``profile`` of :func:`verify_synthetic` or
    :func:`synthetic_accepted_length`). The marginal acceptance of position ``j`` stays ``p_j``
    (``E[q] = p_j``) and a score is a calibrated acceptance probability whatever ``lam``:
    ``lam = 0`` gives every draft ``p_j`` (no per-draft information; no random draw, so the
    acceptance draws are the profile's own), ``lam = 1`` gives ``q`` in ``{0, 1}`` (the score
    is the outcome). Between them a score ranks the drafts that will pass above those that will
    not, as a real draft head's probabilities do, so adaptive verification has something to
    rank by under synthetic acceptance. No host sync (captured graphs).
    """
    b, k = out.shape
    prof = _profile_tensor(profile, k, out.device)  # [1, k]
    if informativeness == 0.0:
        return out.copy_(prof.expand(b, k))
    bern = (torch.rand((b, k), generator=generator, device=out.device) < prof).float()
    return torch.add(prof, (bern - prof) * float(informativeness), out=out)


def verify_forced(
    draft_tokens: torch.Tensor,  # [B, k] int
    target_logits: torch.Tensor,  # [B, k + 1, V]
    *,
    num_verify: torch.Tensor | None = None,  # [B] int, drafts verified per request
) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int64, [B, k + 1] int64
    """Accept every verified draft (``num_accepted = num_verify``, default ``k``).

    The bonus is the target's argmax at row ``num_accepted``. Used by calibration so that every
    round has exactly the grid's shapes.
    """
    b, k, _ = _check_verify(draft_tokens, target_logits)
    num_accepted = _verify_lengths(num_verify, b, k, target_logits.device)
    return num_accepted, _emit(draft_tokens, num_accepted, target_logits.argmax(dim=-1))


def verify_synthetic_tokens(
    draft_tokens: torch.Tensor,  # [B, k] int
    target_tokens: torch.Tensor,  # [B, k + 1] int: the target's argmax of each verify row
    profile: Sequence[float] | torch.Tensor,
    generator: torch.Generator | None,
    *,
    num_verify: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int64, [B, k + 1] int64
    """:func:`verify_synthetic` from argmax tokens (same draws from ``generator``, same result)."""
    b, k = _check_verify_tokens(draft_tokens, target_tokens)
    num_accepted = synthetic_accepted_length(profile, generator, num_verify, b, k,
                                             target_tokens.device)
    return num_accepted, _emit(draft_tokens, num_accepted, target_tokens.long())


def synthetic_accepted_length(
    profile: Sequence[float] | torch.Tensor,
    generator: torch.Generator | None,
    num_verify: torch.Tensor | None,  # [B] int, drafts verified per request
    b: int,
    k: int,
    device,
) -> torch.Tensor:  # [B] int64
    """The accepted lengths of :func:`verify_synthetic_tokens` alone (the same ``[B, k]`` draw
    from ``generator``): the runner emits tokens from them with the fused ``verify_accept``."""
    nv = _verify_lengths(num_verify, b, k, device)
    prof = _profile_tensor(profile, k, device)
    u = torch.rand((b, k), generator=generator, device=device)
    return _accepted_length(u < prof, nv)


def verify_forced_tokens(
    draft_tokens: torch.Tensor,  # [B, k] int
    target_tokens: torch.Tensor,  # [B, k + 1] int: the target's argmax of each verify row
    *,
    num_verify: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int64, [B, k + 1] int64
    """:func:`verify_forced` from argmax tokens (same result)."""
    b, k = _check_verify_tokens(draft_tokens, target_tokens)
    num_accepted = _verify_lengths(num_verify, b, k, target_tokens.device)
    return num_accepted, _emit(draft_tokens, num_accepted, target_tokens.long())


def draft_token_probability(
    draft_logits: torch.Tensor,  # [B, V]
    token: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B] float32
    """The draft's probability of its selected token: ``exp(logit[token] - logsumexp(logits))``.

    This is the confidence score adaptive verification uses (untempered, unfiltered).
    """
    if (
        not isinstance(draft_logits, torch.Tensor)
        or draft_logits.dim() != 2
        or (not draft_logits.is_floating_point())
    ):
        shape = tuple(draft_logits.shape) if isinstance(draft_logits, torch.Tensor) else None
        raise InputError("draft_logits", shape, "a floating tensor of shape [batch, vocab]")
    b = draft_logits.shape[0]
    if (
        not isinstance(token, torch.Tensor)
        or tuple(token.shape) != (b,)
        or (token.is_floating_point())
    ):
        shape = tuple(token.shape) if isinstance(token, torch.Tensor) else token
        raise InputError("token", shape, f"an integer tensor of shape [{b}]")
    x = draft_logits.float()
    selected = x.gather(1, token.long()[:, None]).squeeze(1)
    return torch.exp(selected - torch.logsumexp(x, dim=-1))


# ------------------------------------------------------------------ a round's token selection


def selection_matters(acceptance: str, k: int) -> bool:
    """Whether token selection differs between an all-greedy and a mixed batch at ``k`` draft
    steps (plain decoding, ``sample`` verification)."""
    return k == 0 or acceptance == "sample"


def argmax_only(acceptance: str, k: int, kind: str) -> bool:
    """Whether a round selects tokens from the target's argmax alone (the greedy fast path).

    Plain decoding and ``sample`` verification when the batch is all greedy (``kind``);
    ``greedy``, ``forced`` and ``synthetic`` verification always (they emit argmax tokens).
    """
    return kind == "greedy" or not selection_matters(acceptance, k)


def selection_kinds(acceptance: str, k: int) -> tuple[str, ...]:
    """The target graph variants captured for ``k`` draft steps: ``("greedy", "sample")`` where
    the choice changes the graph and a non-greedy request can be admitted; ``("greedy",)`` where
    every round is argmax-only anyway or the engine refuses non-greedy requests
    (``acceptance="greedy"``)."""
    if selection_matters(acceptance, k) and acceptance != "greedy":
        return ("greedy", "sample")
    return ("greedy",)


def selection_kind(acceptance: str, params: Sequence[SamplingParams], k: int) -> str:
    """The host's choice for one round: ``greedy`` (argmax only) if every request is greedy or
    the choice does not matter, else ``sample``."""
    if not selection_matters(acceptance, k) or batch_is_greedy(params):
        return "greedy"
    return "sample"


def accept(acceptance: str, draft_tokens, logits, num_verify, row_params, profile,
           generator):  # [bcap, k], [bcap, k + 1, V], [bcap], 4 x [bcap] -> (accepted, tokens)
    """A round's acceptance from the target's logits. ``row_params``: each row's
    ``(temperature, top_k, top_p, min_p)`` (``sample`` verification)."""
    if acceptance == "greedy":
        return verify_greedy(draft_tokens, logits, num_verify=num_verify)
    if acceptance == "forced":
        return verify_forced(draft_tokens, logits, num_verify=num_verify)
    if acceptance == "synthetic":
        return verify_synthetic(draft_tokens, logits, profile, generator, num_verify=num_verify)
    return verify_rejection(draft_tokens, logits, *row_params, generator, num_verify=num_verify)


def accept_tokens(acceptance: str, draft_tokens, grid_tokens, num_verify, profile,
                  generator):  # [bcap, k], [bcap, k + 1], [bcap] -> (accepted, tokens)
    """A round's acceptance from the target's argmax tokens (the argmax-only modes; ``greedy``
    or ``sample`` over an all-greedy batch: point masses on the argmax)."""
    if acceptance == "forced":
        return verify_forced_tokens(draft_tokens, grid_tokens, num_verify=num_verify)
    if acceptance == "synthetic":
        return verify_synthetic_tokens(draft_tokens, grid_tokens, profile, generator,
                                       num_verify=num_verify)
    return verify_greedy_tokens(draft_tokens, grid_tokens, num_verify=num_verify)
