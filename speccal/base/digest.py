"""Content digests of JSON values: the one rule for fingerprints that tables compare.

``canonical_json`` (sorted keys, no whitespace, no NaN) and ``json_digest`` (its SHA-256, first
16 hex digits) are used by the kernel configuration (``speccal.kernels.config``) and by the
cost tables that record it (``speccal.costmodel.compat``), so both sides hash alike.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from speccal.base.errors import InputError

DIGEST_CHARS = 16

__all__ = ["DIGEST_CHARS", "canonical_json", "json_digest"]


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, no NaN: the text :func:`json_digest` hashes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def json_digest(value: Any, field: str = "value") -> str:
    """SHA-256 of ``canonical_json(value)``, first ``DIGEST_CHARS`` hex digits. Tuples hash as
    the lists JSON writes, so a value hashes the same before and after a JSON round trip.

    Raises
    ------
    InputError
        ``value`` is not JSON of finite scalars, lists and objects (``field`` names it).
    """
    try:
        text = canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise InputError(field, str(exc), "JSON of finite scalars, lists and objects") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]
