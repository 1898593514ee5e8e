"""``library_op``: a ``torch.library`` operator whose call is a plain dispatcher call.

``torch.library.custom_op`` wraps every call of the operator in Python: an autograd
kernel that checks which inputs require grad, then a backend kernel that checks the
outputs alias no input, before the implementation runs. Inside a compiled graph that is
paid on every call of every op (~30 µs of host time each on a recent x86 core, against
~5 µs for the dispatcher itself), and a compiled training step calls this package's
quantize ops a few hundred times. ``library_op`` registers the same schema (inferred from
the type hints, as ``custom_op`` does) with the implementation directly on
``CompositeExplicitAutograd`` and the fake implementation for tracing, and nothing else:

* no autograd kernel: the ops run inside this package's autograd functions (or compiled
  graphs) on tensors that need no grad; torch's autograd fallback covers any other use;
* no aliasing check: every implementation returns fresh tensors (the tests compare
  against references, and ``mutates_args`` names each input an op writes).

Use it as ``custom_op`` is used::

    @library_op("hybrid_dist::name")
    def name_op(x: torch.Tensor, flag: bool) -> torch.Tensor: ...

    @name_op.register_fake
    def _(x, flag): ...
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}  # namespace -> its fragment (kept alive)


class LibraryOp:
    """An operator made by :func:`library_op`: call it like the function it wraps;
    ``.op`` is the ``OpOverload`` that compiled graphs record, ``.fn`` the function
    (what eager callers run without the dispatcher)."""

    def __init__(self, qualname: str, fn: Callable, mutates_args: Iterable[str]):
        ns, name = qualname.split("::")
        lib = _LIBRARIES.get(ns)
        if lib is None:
            lib = _LIBRARIES[ns] = torch.library.Library(ns, "FRAGMENT")
        lib.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        lib.impl(name, fn, "CompositeExplicitAutograd")
        self._lib, self._qualname, self.fn = lib, qualname, fn
        self.op = getattr(getattr(torch.ops, ns), name).default
        self.__name__, self.__doc__ = getattr(fn, "__name__", name), fn.__doc__

    def register_fake(self, fake: Callable) -> Callable:
        """Register ``fake`` (shapes and dtypes only) for tracing; returns it."""
        torch.library.register_fake(self._qualname, fake, lib=self._lib)
        return fake

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)


def library_op(qualname: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable], LibraryOp]:
    """Decorator: register ``fn`` as the operator ``qualname`` (``"namespace::name"``) with
    the schema inferred from its type hints (see the module note)."""
    return lambda fn: LibraryOp(qualname, fn, mutates_args)


__all__ = ["LibraryOp", "library_op"]
