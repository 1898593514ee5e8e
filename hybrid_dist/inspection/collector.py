"""``StatsCollector``: attach ``ModuleStats`` to a model's recipe modules, capture a step,
read every statistic with one device-to-host copy.

    collector = StatsCollector(model)              # buffers allocated now, nothing runs
    with collector.capture():                      # only at a logging step
        loss = model(x).sum(); loss.backward()
    records = collector.read()                     # [{"module", "tensor_type", ...}, ...]

Outside ``capture()`` the model runs exactly as without a collector (no hook, no op; see
the note in ``capture``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from hybrid_dist.inspection.candidates import GEMM_OF
from hybrid_dist.inspection.capture import ModuleStats, capturing
from hybrid_dist.inspection.stats import decode
from hybrid_dist.recipe_module import RecipeModuleMixin
from hybrid_dist.warn import warn_once

# torch 2.11's compiled backward drops the writes into the statistics buffers (2.13 keeps them)
_COMPILED_BACKWARD_DROPS_WRITES = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)

# wrapper prefixes that are not part of a module's name in the unwrapped model
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean_fqn(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


class StatsCollector:
    """Statistics of every plan of every recipe module of ``model`` (those whose plans
    carry a ``stats`` slot: ``hd.Linear``, also under tensor parallelism, and ``GroupedLinear``).
    ``candidates``: also measure the candidate formats. ``device``: where the buffers live
    (the compute device; default: each module's weight's, e.g. not CPU-offloaded ones)."""

    def __init__(self, model: nn.Module, *, candidates: bool = True, device: torch.device | None = None):
        self.modules: list[ModuleStats] = []
        if _COMPILED_BACKWARD_DROPS_WRITES and any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
                                                   for m in model.modules()):
            warn_once(
                f"hybrid_dist statistics: torch {torch.__version__}'s compiled backward drops the writes "
                "to the statistics buffers, so the grad_output rows of compiled steps read as "
                "unwritten; torch >= 2.13 records them (the forward rows are right either way).",
                key="compiled-backward-stats")
        for fqn, mod in model.named_modules():
            if not isinstance(mod, RecipeModuleMixin):
                continue
            weight = mod.__dict__.get("_parameters", {}).get("weight")
            if device is not None:
                where = device
            else:
                where = weight.device if weight is not None and weight.device.type != "meta" else torch.device("cpu")
            for plan in mod.plans():
                if not hasattr(plan, "stats"):
                    continue
                plan.stats = ModuleStats(name=clean_fqn(fqn), plan=plan, device=where, candidates=candidates)
                self.modules.append(plan.stats)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        for m in self.modules:
            m.reset()
        with capturing():
            yield

    def read(self) -> list[dict]:
        """One record per written row: ``module``, ``tensor_type``, ``direction``, ``gemm``,
        ``format``, ``used`` (the recipe's format, else a candidate), then ``stats.decode``'s
        fields (``scope`` among them). One device-to-host copy."""
        if not self.modules:
            return []
        host = torch.cat([m.buf.reshape(-1).to(self.modules[0].buf.device) for m in self.modules]).cpu().tolist()
        out, off = [], 0
        for m in self.modules:
            width = m.buf.shape[1]
            for i, (t, d, label, used) in enumerate(m.rows):
                vec = host[off + i * width: off + (i + 1) * width]
                if vec[6] == 0:  # numel: the row was not written in this capture
                    continue
                out.append({"module": m.name, "tensor_type": t, "direction": d, "gemm": GEMM_OF[(t, d)],
                            "format": label, "used": used, **decode(vec)})
            off += m.buf.numel()
        return out
