"""One-time warnings: a fallback warns once per reason and says why (docs/design.md §4.5)."""

from __future__ import annotations

import warnings

_WARNED: set[str] = set()


def warn_once(message: str, *, stacklevel: int = 3, key: str | None = None) -> None:
    """Emit ``message`` as a ``UserWarning`` the first time it (or ``key``, when given:
    messages that differ only in detail, e.g. a layer name) is seen in this process."""
    seen = message if key is None else key
    if seen not in _WARNED:
        _WARNED.add(seen)
        warnings.warn(message, stacklevel=stacklevel)
