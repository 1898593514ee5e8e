"""Makes Triton's interpreter index with its scalars under NumPy >= 2.4.

The interpreter holds a kernel's scalars (e.g. an int argument ``K``) as 1-element NumPy
arrays and converts them for ``range(0, K, BK)`` with ``int(array)``; NumPy 2.4 refuses
that for arrays that are not 0-d (``TypeError: only 0-dimensional arrays can be converted
to Python scalars``; seen with Triton 3.6.0 + NumPy 2.4). ``install()`` converts with
``.item()`` instead, which still refuses arrays of more than one element. Interpreter
runs only (``tests._helpers.run_under_triton_interpreter``); compiled kernels never see it.
"""

from __future__ import annotations


def install() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_hd_item_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)  # the scope restores in reverse order: ours is undone first
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._hd_item_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
