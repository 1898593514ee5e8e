"""``benchmarks.trace_summary`` on a hand-made Kineto trace: stream busy time, the compute
stream's idle time per launcher region, and kernel categories."""

import gzip
import json

from benchmarks import trace_summary


def _kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _trace(tmp_path, events) -> str:
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_union_and_gaps():
    assert trace_summary.union_ms([(0, 1000), (500, 2000), (3000, 4000)]) == 3.0
    assert trace_summary.gaps([(10, 20), (15, 30), (50, 60)], 0, 100) == [(0, 10), (30, 50), (60, 100)]


def test_categories():
    assert trace_summary.category("nvjet_sm90_qqtst_128x256") == "gemm"
    assert trace_summary.category("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert trace_summary.category("_cast_transpose_kernel") == "quantize"
    assert trace_summary.category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert trace_summary.category("triton_per_fused__fused_rms_norm_mul") == "norm/act (fused)"


def test_summary_of_a_trace(tmp_path, capsys):
    events = [_kernel("nvjet_gemm", 0, 1000, 7), _kernel("nvjet_gemm", 3000, 1000, 7),
              _kernel("ncclDevKernel_AllGather", 0, 4000, 20),
              {"ph": "X", "cat": "gpu_user_annotation", "name": "hd::forward", "ts": 0, "dur": 4000,
               "args": {}}]
    trace_summary.summarize(_trace(tmp_path, events), n_gaps=2)
    out = capsys.readouterr().out
    assert "GPU window 4.0 ms" in out
    assert "compute stream 7: busy 2.0 ms, idle 2.0 ms" in out
    assert "hd::forward         4.0 ms on the GPU timeline, compute idle     2.0 ms" in out
    assert "gemm               x2          2.0 ms" in out


def _host(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}


def test_host_per_compiled_block(tmp_path, capsys):
    """Two compiled blocks in the last forward: the mean per block of each nested call,
    by depth; FSDP's pre-forward per call; events of other threads and of the earlier
    forward left out."""
    events = [_host("hd::forward", 0, 100, "user_annotation"),  # an earlier step's forward
              _host("Torch-Compiled Region: 0/0", 10, 50),
              _host("hd::forward", 1000, 1000, "user_annotation"),
              _host("FSDP::pre_forward (layers.0)", 1000, 40, "user_annotation"),
              _host("FSDP::pre_forward (layers.1)", 1300, 60, "user_annotation")]
    for start in (1100, 1400):  # two blocks: 100 us each, a GEMM of 30 and a launch of 10 inside it
        events += [_host("Torch-Compiled Region: 0/0", start, 100),
                   _host("aten::_scaled_mm", start + 10, 30),
                   _host("cuLaunchKernel", start + 12, 10, "cuda_driver"),
                   _host("cuLaunchKernel", start + 60, 10, "cuda_driver")]
    events.append(_host("aten::_scaled_mm", 1110, 500, tid=2))  # another thread
    trace_summary.host_blocks(_trace(tmp_path, events), top=5)
    out = capsys.readouterr().out
    assert "FSDP::pre_forward in the last forward: 2 calls, 50 us each" in out
    assert "host per compiled block in the last forward (2 blocks): 100 us" in out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "0 aten::_scaled_mm n/block 1.0 us/block 30.0" in lines
    assert "1 cuLaunchKernel n/block 1.0 us/block 10.0" in lines  # inside the GEMM
    assert "0 cuLaunchKernel n/block 1.0 us/block 10.0" in lines  # directly in the region
