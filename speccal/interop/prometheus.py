"""The Prometheus text exposition format (version 0.0.4), as a ``/metrics`` endpoint serves it.

One sample per line: ``name{label="value",...} value [timestamp]`` (the label block optional);
lines starting with ``#`` (``# HELP``, ``# TYPE``) and blank lines are skipped. Label values may
hold the escapes ``\\\\``, ``\\"`` and ``\\n``. Values are floats (``NaN``, ``+Inf`` and
``-Inf`` included). A counter registered as ``x`` by ``prometheus_client`` is served as
``x_total`` (and ``x_created``, its creation time); :func:`counter_samples` finds either
spelling and never the ``_created`` series.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from speccal.base.errors import InputError

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|(?=}))')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class Sample(NamedTuple):
    """One sample line: metric name, labels (sorted ``(name, value)`` pairs) and value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, name: str) -> str | None:
        return dict(self.labels).get(name)


def _unescape(text: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], text)


def _value(token: str) -> float:
    low = token.lower()
    if low in ("nan", "+nan", "-nan"):
        return math.nan
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    return float(token)


def parse_exposition(text: str, field: str = "metrics") -> list[Sample]:
    """Every sample of a text exposition, in file order.

    Raises
    ------
    InputError
        A line that is not a comment, blank or a sample (names the line number).
    """
    out = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        rest = line[m.end() :] if m else ""
        labels: list[tuple[str, str]] = []
        ok = m is not None
        if ok and rest.startswith("{"):
            body = rest[1:]
            while ok and not body.lstrip().startswith("}"):
                lm = _LABEL.match(body)
                if lm is None:
                    ok = False
                    break
                labels.append((lm.group(1), _unescape(lm.group(2))))
                body = body[lm.end() :]
            rest = body.lstrip()[1:] if ok else ""
        parts = rest.split()
        if ok and len(parts) in (1, 2):
            try:
                value = _value(parts[0])
            except ValueError:
                ok = False
        else:
            ok = False
        if not ok:
            raise InputError(
                f"{field}: line {n}",
                raw[:80],
                'a Prometheus text-format sample (name{label="value",...} value) or a # comment',
            )
        out.append(Sample(m.group(0), tuple(sorted(labels)), value))
    return out


def counter_samples(samples: list[Sample], name: str) -> list[Sample]:
    """Samples of counter ``name``, served as ``name_total`` or as ``name`` (never
    ``name_created``)."""
    base = name.removesuffix("_total")
    return [s for s in samples if s.name in (base, base + "_total")]
