"""``--fsdp-unit 0`` (the default) sizes FSDP units by the blocks' parameter count
(``launch.parallelize.blocks_per_unit``): one 8b block a unit, four 1b blocks, never more
than a quarter of the blocks; an explicit unit is kept."""

import pytest
import torch

from hybrid_dist.launch.model import Transformer
from hybrid_dist.launch.parallelize import AUTO_UNIT_PARAMS, blocks_per_unit, fsdp_units
from hybrid_dist.launch.presets import preset


def _meta_model(name: str, **kw) -> Transformer:
    with torch.device("meta"):
        return Transformer(preset(name, **kw))


@pytest.mark.parametrize("name, kw, unit", [
    ("8b", {}, 1),                                  # 218M parameters a block
    ("1b", {}, 4),                                  # 61M: four blocks reach 200M
    ("125m", {}, 3),                                # 6.3M: capped at a quarter of 12 blocks
    ("tiny", {}, 1),                                # two blocks: a quarter rounds to none
    ("1b", {"moe_experts": 8, "moe_top_k": 2}, 1),  # 413M with its experts
])
def test_auto_unit_by_block_parameters(name, kw, unit):
    model = _meta_model(name, **kw)
    assert blocks_per_unit(model, 0) == unit, f"{name} {kw}"
    n = len(model.layers)
    assert [len(u) for u in fsdp_units(model, 0)] == [unit] * (n // unit) + ([n % unit] if n % unit else [])


def test_auto_unit_reaches_the_parameter_target():
    model = _meta_model("1b")
    block = sum(p.numel() for p in model.layers["0"].parameters())
    assert (blocks_per_unit(model, 0) - 1) * block < AUTO_UNIT_PARAMS <= blocks_per_unit(model, 0) * block


def test_explicit_unit_is_kept():
    model = _meta_model("8b", layers=4)
    assert blocks_per_unit(model, 3) == 3
    assert fsdp_units(model, 3) == [list(model.layers.values())[:3], list(model.layers.values())[3:]]
