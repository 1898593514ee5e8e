"""``benchmarks/tp.py`` on 2 gloo ranks at tiny shapes: one row per recipe and the
gathered bytes of each path. A step gathers fc1's input (forward), fc2's output gradient
and fc1's input again (backward). bf16 gathers move 2 bytes per element; per-tensor FP8 1,
with the gradient's columnwise derived from its rowwise bytes; MXFP8 1 + 1/32, with the
gradient gathered in both directions."""

from __future__ import annotations

import types

from torch.distributed.device_mesh import init_device_mesh

from benchmarks.tp import table_rows
from tests_distributed._harness import run_ranks

SEQ, HIDDEN, FFN = 64, 64, 128


def _rows(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"]
    args = types.SimpleNamespace(seq=SEQ, hidden=HIDDEN, ffn=FFN, iters=1, rounds=2, device="cpu", profile=set(),
                                 compile=False)
    return table_rows(["bf16", "fp8_current", "mxfp8"], mesh, args)


def test_tp_benchmark_rows_and_gathered_bytes_on_two_ranks():
    per_rank = run_ranks(_rows, 2)
    assert [r[0] for r in per_rank[0]] == [r[0] for r in per_rank[1]] == ["bf16", "fp8_current", "mxfp8"]
    assert [r[4:] for r in per_rank[0]] == [r[4:] for r in per_rank[1]], "ranks disagree on bytes"
    mib = 2**20
    for rows in per_rank:
        by = {r[0]: r for r in rows}
        for name, (_, hp_ms, q_ms, speedup, hp_ag, q_ag, rs) in by.items():
            mid, lo, hi = (float(v.strip("[],")) for v in speedup.split())  # median of 2 rounds [min, max]
            assert hp_ms > 0 and q_ms > 0 and 0 < lo <= mid <= hi, f"{name}: {by[name]}"
            # three gathers of [SEQ, HIDDEN] per step (fc1's input forward, fc2's output grad
            # and fc1's input again for wgrad) in bf16: what the bf16 path moves
            assert hp_ag * mib == 3 * SEQ * HIDDEN * 2, f"{name}: bf16 gathers moved {hp_ag * mib} bytes"
        assert by["bf16"][5] == by["bf16"][4], "bf16 gathers nothing quantized"
        fp8_bytes = by["fp8_current"][5] * mib
        assert fp8_bytes == 3 * SEQ * HIDDEN, fp8_bytes  # 1 B/elem; dy's columnwise derived, not sent
        mx_bytes = by["mxfp8"][5] * mib
        assert mx_bytes == 4 * SEQ * HIDDEN * (1 + 1 / 32), mx_bytes  # dy gathered both ways
