"""One-time warnings: a fallback warns once per reason and says why (DESIGN §4.5)."""

from __future__ import annotations

import warnings

_WARNED: set[str] = set()


def warn_once(message: str, *, stacklevel: int = 3) -> None:
    """Emit ``message`` as a ``UserWarning`` the first time it is seen in this process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=stacklevel)
