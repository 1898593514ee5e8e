"""``benchmarks.spy_summary`` on made collapsed stacks: samples of the training processes
only, compilation and first calls left out, regions and inclusive per-function shares."""

from __future__ import annotations

import gzip

from benchmarks import spy_summary

AGENT = 'process 10:"torchrun"'
P = f'{AGENT};process 11:"python -m hybrid_dist.launch.train"'  # py-spy names the parent, then the rank
TRAIN = f"{P};<module> (train.py:1);train (loop.py:380);train_step (loop.py:170)"
LINES = [
    f"{TRAIN};forward (model.py:60);__call__ (eval_frame.py:400) 30",
    f"{TRAIN};forward (model.py:60);_compile_inner (convert_frame.py:700) 500",  # compiling: left out
    f"{TRAIN};cast (fp8_tensor.py:9);launch (_launch.py:124);JITFunction._do_compile (jit.py:3) 40",  # Triton JIT
    f"{P};_worker (threading.py:1);backward (x.py:1);launch (_launch.py:124);JITFunction.run (jit.py:743);"
    "CompiledKernel._init_handles (compiler.py:452);compile_module_from_src (build.py:84) 52",  # a first load
    f"{P};_worker (threading.py:1);backward (x.py:1);launch (_launch.py:124);run (jit.py:710);"
    "_find_and_load (<frozen importlib._bootstrap>:1360) 12",  # an import at a first launch: left out
    f"{TRAIN};forward (model.py:60);_AnalyzeCustomOpInputOutputMode.__torch_dispatch__ "
    "(runtime_wrappers.py:409) 6",  # a compiled graph's first run: left out
    f"{TRAIN};MasterWeightOptimizer.step (optim.py:120);requantize_many_ (requantize_many.py:30) 10",
    f"{TRAIN};backward (_tensor.py:600);_engine_run_backward (graph.py:800) 5",
    f"{P};_worker (threading.py:1);CompiledFunction.backward (runtime_wrappers.py:2000);call (x.py:3) 50",
    f"{P};_worker (threading.py:1);run (heartbeat.py:20) 7",  # another thread: left out
    f"{AGENT};<module> (torchrun:1);monitor (agent.py:3) 99",  # not a training process
]


def test_regions_and_shares(tmp_path):
    path = tmp_path / "spy.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(LINES) + "\n")
    kept, per_region, funcs = spy_summary.summarize(spy_summary.read_stacks(str(path)))
    assert kept == 95 and per_region == {"forward": 30, "optimizer": 10, "backward": 55}, (kept, per_region)
    assert funcs["optimizer"]["requantize_many_ (requantize_many.py)"] == 10
    assert funcs["backward self"] == {"call (x.py)": 50, "_engine_run_backward (graph.py)": 5}
    assert funcs["backward"]["CompiledFunction.backward (runtime_wrappers.py)"] == 50
    assert not any(name.startswith("process ") or name == "train_step (loop.py)" for c in funcs.values() for name in c)
    text = spy_summary.format_summary("spy", kept, per_region, funcs, top=3)
    assert "forward: 31.6% of samples" in text and "backward: 57.9% of samples" in text, text
