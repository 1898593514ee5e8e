"""``examples/per_layer_recipe.py``: its recipe keeps the end blocks in bf16 and quantizes
the others (as the launcher's model names them), loads through ``--recipe path:attr``, and
its tiny default trains next to bf16."""

from __future__ import annotations

import importlib.util
import os

import hybrid_dist as hd
from hybrid_dist.launch.config import load_recipe

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "per_layer_recipe.py")


def _example():
    spec = importlib.util.spec_from_file_location("per_layer_recipe", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_by_block_and_through_the_launcher():
    loaded = load_recipe(f"{PATH}:recipe")
    kinds = [type(loaded.quantizer(hd.Role(tensor_type=t, name=f"layers.{i}.feed_forward.w2"))).__name__
             for i in range(4) for t in ("input", "grad_output")]
    assert kinds == ["IdentityQuantizer"] * 2 + ["HybridQuantizer", "NVFP4Quantizer"] * 2 + ["IdentityQuantizer"] * 2
    assert type(loaded.quantizer(hd.Role(tensor_type="weight", name="output"))).__name__ == "IdentityQuantizer"


def test_tiny_default_trains_next_to_bf16():
    out = _example().main(["--steps", "6"])
    (bf16, ref), (name, mixed) = out.items()
    assert bf16 == "bf16" and name.startswith("bf16_ends_mxfp8_fwd_nvfp4_bwd")
    assert abs(mixed[0] - ref[0]) < 0.05, (mixed[0], ref[0])  # same init and data; quantized middle blocks
    assert mixed[-1] < mixed[0] - 1.0 and abs(mixed[-1] - ref[-1]) < 0.2, (mixed, ref)
    assert mixed != ref  # the middle blocks are quantized
