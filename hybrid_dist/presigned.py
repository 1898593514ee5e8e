"""``presigned``: a method whose bound form carries its signature, built once.

FSDP2 calls ``inspect.signature`` on a parameter's ``fsdp_pre_all_gather`` at every
unshard, to pick one of its two calling conventions. For an ordinary bound method that
builds a new ``inspect.Signature`` each time (about 10 µs, per parameter and unshard). An
object with its own ``__signature__`` is answered from it, so the bound form here is a
small callable holding the signature without ``self``, computed when the class is made.
Calling it calls the function with the instance first, as a bound method does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


class _Bound:
    """``fn`` bound to ``obj``, with the bound signature ready for ``inspect.signature``."""

    __slots__ = ("_fn", "_obj", "__signature__")

    def __init__(self, fn: Callable, obj: Any, signature: inspect.Signature):
        self._fn, self._obj, self.__signature__ = fn, obj, signature

    def __call__(self, *args, **kwargs):
        return self._fn(self._obj, *args, **kwargs)


class presigned:  # noqa: N801 (used as a decorator, like ``property``)
    """Decorator for a method: instances see a ``_Bound`` carrying the signature without
    ``self``; the class sees the plain function."""

    def __init__(self, fn: Callable):
        functools.update_wrapper(self, fn)
        self._fn = fn
        params = list(inspect.signature(fn).parameters.values())[1:]
        self._bound_signature = inspect.Signature(params)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self._fn
        return _Bound(self._fn, obj, self._bound_signature)


__all__ = ["presigned"]
