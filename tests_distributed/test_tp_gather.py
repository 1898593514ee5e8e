"""gather_along_first_dim / reduce_scatter_along_first_dim on gloo (TP = 2 and 4), and the
same checks over NCCL (``gpu``: 2 or 4 GPUs of one host, path (b) against the CUDA kernels).

One 4-rank run checks every configuration on the world group (TP=4) and on two
2-rank subgroups (TP=2). Each rank returns the configurations that failed; the parent
asserts none did, naming them. Asserted per format and direction:

* path (b) (quantize shard, gather quantized) == path (a) (gather, quantize) ==
  quantizing the full tensor in one process, bitwise (all storage fields);
* bytes on the wire of path (b) per direction = the formula of the format;
* stochastic rounding: scales bitwise equal, every code one of the two E2M1 neighbours;
* unaligned shards fall back to path (a) with a warning and stay bitwise equal;
* async handles return the same result; plain gather / reduce-scatter are exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from hybrid_dist.formats.nvfp4 import NVFP4Storage
from hybrid_dist.derived_columnwise import derivable_columnwise
from hybrid_dist.tensor_parallel import gather_along_first_dim, record_wire_bytes, reduce_scatter_along_first_dim
from tests._helpers import assert_storage_equal
from tests_distributed._harness import nccl_world, run_nccl, run_ranks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
K = 128
_DEVICE = torch.device("cpu")  # set per worker by _rank_fn (cuda:<rank> in the NCCL variant)


def _quantizers():
    """name -> quantizer: every format, option and a hybrid pair."""
    return {
        "fp8_e4m3": hd.Float8Quantizer(dtype=E4M3),
        "fp8_e5m2_pow2": hd.Float8Quantizer(dtype=E5M2, power_of_2_scales=True),
        "fp8_delayed": hd.Float8Quantizer(dtype=E4M3, scaling="delayed"),
        "fp8_block_1x128": hd.Float8BlockQuantizer(block="1x128"),
        "fp8_block_128x128": hd.Float8BlockQuantizer(block="128x128"),
        "mxfp8": hd.MXFP8Quantizer(),
        "nvfp4": hd.NVFP4Quantizer(),
        "nvfp4_rht": hd.NVFP4Quantizer(rht=True, rht_seed=3),
        "nvfp4_2d": hd.NVFP4Quantizer(block_2d=True),
        "identity": hd.IdentityQuantizer(),
        "hybrid_mxfp8_nvfp4rht": hd.HybridQuantizer(rowwise=hd.MXFP8Quantizer(),
                                                    columnwise=hd.NVFP4Quantizer(rht=True)),
        "hybrid_fp8_identity": hd.HybridQuantizer(rowwise=hd.Float8Quantizer(), columnwise=hd.IdentityQuantizer()),
    }


def expected_bytes(fmt: str, m: int, k: int) -> int:
    """Bytes of one gathered direction of a logical ``[m, k]`` fp32 tensor (per-tensor
    scales are not sent: the amax all-reduce makes them equal on every rank)."""
    n = m * k
    return {
        "fp8": n,                                  # 1 B/elem
        "fp8_block_1x128": n + 4 * n // 128,       # + fp32 per 128
        "fp8_block_128x128": n + 4 * n // (128 * 128),
        "mxfp8": n + n // 32,                      # + E8M0 per 32
        "nvfp4": n // 2 + n // 16,                 # 4 bits + E4M3 per 16
        "nvfp4_2d": n // 2 + n // 256,             # 4 bits + E4M3 per 16x16
        "identity": 4 * n,
    }[fmt]


def _fmt_key(name: str, direction: str) -> str:
    q = _quantizers()[name].direction_quantizer(direction)
    if isinstance(q, hd.Float8BlockQuantizer):
        return f"fp8_block_{q.block}"
    if isinstance(q, hd.NVFP4Quantizer):
        return "nvfp4_2d" if q.block_2d else "nvfp4"
    return q.FORMAT


def _groups(rank, world):
    """(tp_size, group, rank in group, group ranks) for TP=world and TP=2 subgroups."""
    out = [(world, dist.group.WORLD, rank, list(range(world)))]
    if world == 4:
        subs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        out.append((2, subs[rank // 2], rank % 2, [rank // 2 * 2, rank // 2 * 2 + 1]))
    return out


def _full_input(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2, K, generator=g) * torch.logspace(-2, 2, K)  # [d0, B, K]; wide range
    return x.to(_DEVICE)


def _check_paths(name, q, tp, group, grank, fails, bytes_seen):
    rows_local = 128  # [64, 2, K] per rank → M_local = 128: every block fits
    x_full = _full_input(tp, rows_local // 2 * tp)
    for dirs in ((True, False), (False, True), (True, True)):
        cfg = f"TP={tp} {name} rowwise={dirs[0]} columnwise={dirs[1]}"
        states = [q.make_state() for _ in range(3)]
        try:
            for step in range(2):  # step 1: delayed scaling uses the history of step 0
                xs = x_full * (1.0 + step)
                ref = q.quantize(xs, rowwise=dirs[0], columnwise=dirs[1], state=states[0])
                a = gather_along_first_dim(xs.chunk(tp)[grank], group, quantizer=q, rowwise=dirs[0],
                                           columnwise=dirs[1], state=states[1], path="high_precision")
                with record_wire_bytes() as log:
                    b = gather_along_first_dim(xs.chunk(tp)[grank], group, quantizer=q, rowwise=dirs[0],
                                               columnwise=dirs[1], state=states[2], path="quantized")
                for d in ("rowwise", "columnwise"):
                    assert_storage_equal(a.storage_of(d), ref.storage_of(d), f"{cfg} step={step} (a) vs full {d}")
                    assert_storage_equal(b.storage_of(d), ref.storage_of(d), f"{cfg} step={step} (b) vs full {d}")
                    if ref.storage_of(d) is not None:
                        got = log.total("all_gather", d)
                        want = expected_bytes(_fmt_key(name, d), x_full.numel() // K, K)
                        if derivable_columnwise(q):  # only the rowwise bytes travel (the columnwise's
                            assert log.total("all_gather", "columnwise") == 0, cfg  # transport layout)
                            got = log.total("all_gather")
                            want = expected_bytes(_fmt_key(name, "rowwise"), x_full.numel() // K, K)
                        assert got == want, f"{cfg} {d}: {got} bytes on the wire, expected {want}"
                        bytes_seen[f"{name}/{d}"] = got / x_full.numel()
                for s in states:
                    q.advance_state(s)
        except AssertionError as e:
            fails.append(str(e))


def _e2m1_neighbours_ok(st: NVFP4Storage, x_stored: torch.Tensor) -> bool:
    """Every SR code is one of the two E2M1 grid values bracketing x/scale."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=x_stored.device)
    r, c = st.shape2d
    scale = (st.block_scale.float().repeat_interleave(16, dim=1) * st.global_scale)
    y = (x_stored.abs() / scale).clamp(max=6.0)
    lo = grid[(torch.searchsorted(grid, y, right=True) - 1).clamp(min=0)]
    hi = grid[torch.searchsorted(grid, y).clamp(max=7)]
    v = (st.values() / st.block_scale.float().repeat_interleave(16, dim=1)).abs()
    return bool(((v == lo) | (v == hi)).all())


def _check_sr(tp, group, grank, fails):
    q = hd.NVFP4Quantizer(stochastic_rounding=True, seed=7)
    x_full = _full_input(11, 64 * tp)
    x_loc = x_full.chunk(tp)[grank]
    a = gather_along_first_dim(x_loc, group, quantizer=q, columnwise=True, state=q.make_state(), path="high_precision")
    b = gather_along_first_dim(x_loc, group, quantizer=q, columnwise=True, state=q.make_state(), path="quantized")
    x2d = x_full.reshape(-1, K)
    for d, xs in (("rowwise", x2d), ("columnwise", x2d.t())):
        sa, sb = a.storage_of(d), b.storage_of(d)
        try:
            assert_storage_equal(sa.with_tensors({"data": sb.data}), sb, f"TP={tp} nvfp4 SR {d} scales (a) vs (b)")
            assert _e2m1_neighbours_ok(sb, xs), f"TP={tp} nvfp4 SR {d}: a code is not an E2M1 neighbour"
            assert _e2m1_neighbours_ok(sa, xs), f"TP={tp} nvfp4 SR {d}: (a) code not a neighbour"
        except AssertionError as e:
            fails.append(str(e))


def _check_misc(tp, group, grank, fails, first):
    x_full = _full_input(5, 8 * tp)  # M_local = 16 rows: MXFP8 columnwise needs 32
    x_loc = x_full.chunk(tp)[grank]
    q = hd.MXFP8Quantizer()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = gather_along_first_dim(x_loc, group, quantizer=q, columnwise=True)
    ref = q.quantize(x_full, rowwise=True, columnwise=True)
    try:
        n_warn = sum("straddle" in str(w.message) for w in rec)
        assert n_warn == (1 if first else 0), f"TP={tp}: {n_warn} fallback warnings, want one per process"
        for d in ("rowwise", "columnwise"):
            assert_storage_equal(out.storage_of(d), ref.storage_of(d), f"TP={tp} mxfp8 fallback {d}")
        h = gather_along_first_dim(x_loc, group)
        assert torch.equal(h, x_full), f"TP={tp}: plain gather differs from torch.cat"
        h = gather_along_first_dim(x_loc, group, async_op=True).wait()
        assert torch.equal(h, x_full), f"TP={tp}: async plain gather differs"
        hq = gather_along_first_dim(_full_input(6, 64 * tp).chunk(tp)[grank], group, quantizer=q,
                                    columnwise=True, async_op=True).wait()
        rq = q.quantize(_full_input(6, 64 * tp), rowwise=True, columnwise=True)
        for d in ("rowwise", "columnwise"):
            assert_storage_equal(hq.storage_of(d), rq.storage_of(d), f"TP={tp} async quantized {d}")
        parts = [torch.full((2 * tp, 3), float(r + 1), device=_DEVICE) for r in range(tp)]
        rs = reduce_scatter_along_first_dim(parts[grank], group)
        assert torch.equal(rs, sum(parts).chunk(tp)[grank]), f"TP={tp}: reduce-scatter wrong"
        rs2 = reduce_scatter_along_first_dim(parts[grank], group, async_op=True).wait()
        assert torch.equal(rs2, rs), f"TP={tp}: async reduce-scatter differs"
    except AssertionError as e:
        fails.append(str(e))


def _rank_fn(rank, world, device: str = "cpu"):
    global _DEVICE
    _DEVICE = torch.device(device, rank) if device == "cuda" else torch.device(device)
    torch.manual_seed(0)
    fails, bytes_seen = [], {}
    for i, (tp, group, grank, _) in enumerate(_groups(rank, world)):
        for name, q in _quantizers().items():
            _check_paths(name, q, tp, group, grank, fails, bytes_seen)
        _check_sr(tp, group, grank, fails)
        _check_misc(tp, group, grank, fails, first=i == 0)
    return fails, bytes_seen


def test_gather_paths_bitwise_and_bytes():
    results = run_ranks(_rank_fn, 4)
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, "\n".join(fails[:20])
    per_elem = results[0][1]
    assert per_elem["fp8_e4m3/rowwise"] == 1.0 and per_elem["mxfp8/columnwise"] == 1 + 1 / 32
    assert per_elem["nvfp4_rht/columnwise"] == 0.5 + 1 / 16


def test_nvfp4_precomputed_rht_amax_matches_quantize():
    """The additive NVFP4 entry points used by path (b): with the tensor's own
    Hadamard-domain amax, ``quantize_columnwise_rht`` equals ``quantize`` bitwise."""
    q = hd.NVFP4Quantizer(rht=True, rht_seed=5)
    x = _full_input(3, 16).reshape(-1, K)
    _, col = q.quantize_storages(x, rowwise=False, columnwise=True)
    col2 = q.quantize_columnwise_rht(x, amax=None, rht_amax=q.columnwise_rht_amax(x))
    assert_storage_equal(col2, col, "nvfp4 rht columnwise with precomputed amax")
    with pytest.raises(ValueError, match="rht=True"):
        hd.NVFP4Quantizer().columnwise_rht_amax(x)


@pytest.mark.gpu
def test_gather_paths_bitwise_and_bytes_nccl():
    """The same checks over NCCL on 2 or 4 GPUs of one host."""
    results = run_nccl(_rank_fn, nccl_world(), "cuda")
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, "\n".join(fails[:20])
