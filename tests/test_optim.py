"""MasterWeightOptimizer: fp32 masters, in-place quantized write-back, state round trip."""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.demo import build_student, teacher_batches
from tests._helpers import assert_bitwise_equal


def _step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_write_back_is_in_place_and_equals_quantized_master():
    recipe = hd.recipe_from_name("mxfp8_fwd_nvfp4_bwd")
    model = build_student(recipe)
    w = model[0].weight
    buffers = {k: v.data_ptr() for k, v in w.rowwise.tensors().items()}
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    x, y = next(teacher_batches(1))
    _step(model, opt, x, y)
    assert {k: v.data_ptr() for k, v in w.rowwise.tensors().items()} == buffers, "buffers were rebound"
    expect = w.quantizer.quantize(opt.master_of(w))
    for d in ("rowwise", "columnwise"):
        for f, t in w.storage_of(d).tensors().items():
            assert_bitwise_equal(t, getattr(expect.storage_of(d), f), f"{d}.{f}")
    assert opt.master_of(w).dtype == torch.float32


def test_masters_start_from_high_precision_init():
    torch.manual_seed(0)
    recipe = hd.recipe_from_name("nvfp4")
    with hd.quantized_model_init(recipe):
        lin = hd.Linear(64, 64, recipe=recipe)
    hp = lin.weight._hd_hp_init.clone()
    opt = hd.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.1)
    assert_bitwise_equal(opt.master_of(lin.weight), hp, "master = exact init, not dequantized NVFP4")
    assert not hasattr(lin.weight, "_hd_hp_init")


def test_state_dict_resume_is_bitwise():
    recipe = hd.recipe_from_name("fp8_current")
    batches = list(teacher_batches(6))
    model = build_student(recipe)
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    straight = [_step(model, opt, *b) for b in batches]

    model = build_student(recipe)
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    first = [_step(model, opt, *b) for b in batches[:3]]
    msd, osd = model.state_dict(), opt.state_dict()
    model2 = build_student(recipe, seed=123)
    opt2 = hd.MasterWeightOptimizer(torch.optim.AdamW, model2.parameters(), lr=1e-2)
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    resumed = first + [_step(model2, opt2, *b) for b in batches[3:]]
    assert resumed == straight


def test_load_state_dict_checks_masters_and_groups():
    model = build_student(hd.recipe_from_name("mxfp8"))
    opt = hd.MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    sd = opt.state_dict()
    quantized = [i for i, p in enumerate(model.parameters()) if isinstance(p, hd.QuantizedTensor)]
    assert len(quantized) == 2 and sorted(sd["state"]) == quantized, "masters of the quantized weights only"
    assert all(set(s) == {"master"} for s in sd["state"].values())
    del sd["state"][quantized[1]]["master"]
    with pytest.raises(ValueError, match=rf"no master weight \('master'\) for parameter #{quantized[1]}"):
        opt.load_state_dict(sd)
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:1]
    with pytest.raises(ValueError, match=r"saved param groups have \[1\] parameters, this optimizer's \[4\]"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("name", ["bf16", "fp8_fwd_bf16_bwd"])
def test_master_takes_init_without_freeing_an_identity_weight(name):
    """An identity (high-precision) direction may hold the very tensor the weight was made
    from; the kept init is then a copy, so the master taking (and freeing) it leaves the
    weight's data intact."""
    torch.manual_seed(0)
    recipe = hd.recipe_from_name(name)
    with hd.quantized_model_init(recipe):
        lin = hd.Linear(64, 64, bias=False, recipe=recipe)
    before = {d: {f: t.clone() for f, t in lin.weight.storage_of(d).tensors().items()}
              for d in ("rowwise", "columnwise")}
    hp = lin.weight._hd_hp_init.clone()
    opt = hd.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.1)
    assert_bitwise_equal(opt.master_of(lin.weight), hp, "master = exact init")
    for d, fields in before.items():
        for f, t in fields.items():
            assert_bitwise_equal(getattr(lin.weight.storage_of(d), f), t, f"{d}.{f} after the master took the init")


def test_is_a_torch_optimizer_over_the_model_parameters():
    """``param_groups`` hold the model's parameters and the hyperparameters an LR scheduler
    sets (copied into the wrapped optimizer at each step); ``state[p]`` is the state of
    ``p``'s master."""
    model = build_student(hd.recipe_from_name("fp8_current"))
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    assert not opt.state and len(opt.state) == 0
    x, y = next(teacher_batches(1))
    for _ in range(2):
        _step(model, opt, x, y)
        sched.step()
    assert opt.param_groups[0]["lr"] == 1e-2 * 0.25
    assert opt.optimizer.param_groups[0]["lr"] == 1e-2 * 0.5, "the second step ran with the scheduled lr"
    w = model[0].weight
    assert opt.state[w] is opt.optimizer.state[opt.master_of(w)] and int(opt.state[w]["step"]) == 2
    assert w in opt.state and len(opt.state) == len(list(model.parameters()))
