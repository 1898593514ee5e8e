"""``examples/torchtitan_converter.py``: its tiny default converts torchtitan's Llama 3 by
configuration (11 Linears), and the converted model trains next to the unconverted one; with
``--moe`` torchtitan's tiny Qwen3 MoE, its experts converted too.
Skipped without torchtitan."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e \".[torchtitan]\")")

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchtitan_converter.py")


def test_tiny_default_trains_next_to_unconverted(capsys):
    spec = importlib.util.spec_from_file_location("torchtitan_converter", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--steps", "6"])
    (ref_name, ref), (name, got) = out.items()
    assert (ref_name, name) == ("unconverted", "mxfp8_fwd_nvfp4_bwd")
    assert "11 Linears converted to HybridLinear" in capsys.readouterr().out
    assert got != ref and abs(got[0] - ref[0]) < 0.05, (got, ref)  # same init; quantized GEMMs
    assert got[-1] < got[0] - 1.0 and abs(got[-1] - ref[-1]) < 0.3, (got, ref)


def test_tiny_moe_converts_experts_and_trains(capsys):
    spec = importlib.util.spec_from_file_location("torchtitan_converter", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--moe", "--steps", "6"])
    (_, ref), (_, got) = out.items()
    assert "5 Linears converted to HybridLinear, 2 experts to HybridGroupedExperts" in capsys.readouterr().out
    assert got != ref and abs(got[0] - ref[0]) < 0.05, (got, ref)  # same init; quantized GEMMs
    assert got[-1] < got[0] - 0.5 and abs(got[-1] - ref[-1]) < 0.3, (got, ref)
