"""Stochastic rounding resumes bitwise on the GPU through ``hd.Linear``'s state dict: the
CUDA kernels' Philox key (advanced on the device every call) is saved and loaded in place
(``NVFP4State.state_dict``, the note on quantizer states in ``recipe_module``), also into a
module that is on the CPU when it loads and moves to the GPU afterwards."""

from __future__ import annotations

import io

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.recipe_module import QUANTIZER_STATE_KEY

pytestmark = pytest.mark.gpu
M, K, N = 256, 512, 384
RECIPE = "mxfp8_fwd_nvfp4_bwd"  # grad_output: NVFP4 with stochastic rounding (the kernels' key)


def _steps(lin, xs, dys) -> list[torch.Tensor]:
    """The weight gradient of each step (stochastic rounding acts in backward)."""
    out = []
    for x, dy in zip(xs, dys):
        lin.zero_grad()
        lin(x.clone().requires_grad_(True)).backward(dy)
        out.append(lin.weight.grad.clone())
    return out


def _build(device: str, *, cpu_step: bool = False) -> hd.Linear:
    lin = hd.Linear(K, N, recipe=hd.recipe_from_name(RECIPE), device=device, dtype=torch.bfloat16)
    if cpu_step:  # its plan (and CPU-side states) exist before the load
        lin(torch.randn(32, K, dtype=torch.bfloat16, device=device)).sum().backward()
    return lin


def test_sr_kernel_key_resumes_bitwise_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(M, K, device="cuda", generator=g).bfloat16() for _ in range(5)]
    dys = [torch.randn(M, N, device="cuda", generator=g).bfloat16() for _ in range(5)]
    torch.manual_seed(0)
    a = _build("cuda")
    _steps(a, xs[:3], dys[:3])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    key = sd[QUANTIZER_STATE_KEY][RECIPE]["grad_output"]["kernel_key"]
    assert key.is_cuda, "the saved key is the live device tensor's value"
    resumed = {"cuda": _build("cuda"), "cpu, then .cuda()": _build("cpu"),
               "cpu with a plan, then .cuda()": _build("cpu", cpu_step=True)}
    for mod in resumed.values():
        mod.load_state_dict({k: v.cpu() if k == "weight" else v for k, v in sd.items()})
    resumed = {name: mod.cuda() for name, mod in resumed.items()}
    fresh = _build("cuda")
    fresh.load_state_dict({k: v for k, v in sd.items() if k != QUANTIZER_STATE_KEY})
    want = _steps(a, xs[3:], dys[3:])
    for name, mod in resumed.items():
        for step, (u, v) in enumerate(zip(want, _steps(mod, xs[3:], dys[3:]))):
            assert torch.equal(u, v), f"{RECIPE}, loaded on {name}: weight gradient of step {step} differs"
    for step, (u, v) in enumerate(zip(want, _steps(fresh, xs[3:], dys[3:]))):
        assert not torch.equal(u, v), f"{RECIPE}: step {step} is the same with the SR key restarted"
