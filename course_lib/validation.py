"""Input checks shared by the public functions: a bad value raises ``ValueError`` naming it."""

from __future__ import annotations


def positive_int(name: str, value) -> int:
    """``value`` if it is an ``int`` (not a bool) of at least 1, else ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
