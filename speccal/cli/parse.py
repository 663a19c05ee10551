"""Option text -> values: the parsing every ``speccal/cli/cmd_*.py`` shares.

Each parser takes an option's raw text and the flag it came from, returns the typed value and
refuses bad text with ``InputError(flag, text, expected)`` (exit 2, one line, from the root).
Lists are comma- or space-separated unless a parser says otherwise.
"""

from __future__ import annotations

from speccal.base.errors import InputError


def ids(text: str, field: str) -> list[int]:
    """Token ids, ``'1,2,3'`` or ``'1 2 3'``; at least one."""
    try:
        out = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise InputError(field, text, "comma- or space-separated integer token ids") from None
    if not out:
        raise InputError(field, text, "at least one token id")
    return out


def floats(text: str | None, field: str) -> tuple[float, ...] | None:
    """Probabilities (an acceptance profile), separated by commas and / or spaces, in every
    command that takes one; None stays None."""
    if text is None:
        return None
    try:
        return tuple(float(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise InputError(field, text, "comma-separated probabilities") from None


def buckets(text: str | None, *, required: bool) -> tuple[int, ...] | None:
    """``--request-buckets``: integers separated by commas and / or spaces (``1,2,4``,
    ``"1 2 4"``, ``"1, 2"``). None or empty: None (the engine's default buckets), refused where
    ``required`` (``calibrate``: at least one bucket when the flag is given)."""
    if text is None:
        return None
    parts = text.replace(",", " ").split()
    if not parts:
        if required:
            raise InputError("--request-buckets", text, "at least one bucket")
        return None
    try:
        return tuple(int(b) for b in parts)
    except ValueError:
        raise InputError("--request-buckets", text,
                         "integers separated by commas or spaces, e.g. 1,2,4,8") from None


def bench_buckets(text: str | None) -> tuple[int, ...] | None:
    """``bench --request-buckets`` (:func:`buckets`; empty: the engine's default,
    ``speccal.base.geometry.SERVED_REQUEST_BUCKETS`` of the device)."""
    return buckets(text, required=False)


def calibrate_buckets(text: str | None) -> tuple[int, ...] | None:
    """``calibrate --request-buckets`` (:func:`buckets`; given, at least one bucket). Spaces
    separate buckets as commas do (``"1 2"`` once read as 12)."""
    return buckets(text, required=True)


def context(text: str) -> tuple[int, int, int]:
    """``--context P:LO:HI`` -> ``(prefill_tokens, min_kv_length, max_kv_length)``."""
    try:
        p, lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise InputError("--context", text, "PREFILL:MIN_KV:MAX_KV, three integers") from None
    return p, lo, hi


def phase(text: str) -> tuple[float, tuple[float, ...]]:
    """``--phase FRACTION:p1,..,pw`` -> ``(fraction, profile)``."""
    frac, _, prof = text.partition(":")
    try:
        f = float(frac)
    except ValueError:
        raise InputError("--phase", text, "FRACTION:p1,..,pw, e.g. 0.5:0.4,0.3,0.2") from None
    return f, floats(prof, "--phase") or ()


def policies(values: list[str] | None) -> tuple[str, ...]:
    """``--policy`` values, each repeatable or a comma list, blanks dropped."""
    return tuple(t for v in values or () for t in v.split(",") if t.strip())
