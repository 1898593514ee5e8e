"""NVFP4 fused quantize (host side): an amax pass (with the Hadamard-domain amax), then one
pass that reads each ``[BM, BK]`` tile once and writes every requested direction. The
kernels and their data layout in registers: ``nvfp4.tiles``; 1×16 blocks from bf16 (RHT or
not; with stochastic rounding, one direction) take ``nvfp4.words``.

Layouts (``formats.nvfp4``): rowwise ``data [M, K/2]`` uint8 + ``block_scale [M/br, K/16]``
E4M3; columnwise ``data [K, M/2]`` + ``block_scale [K/br, M/16]``; ``br`` = 16 for 2D blocks.

Exactness against the reference (``formats.nvfp4``):

* scales, RNE codes and packing: bitwise, every direction and block shape, for every
  tensor amax (the block scale divides by reciprocals from ``2**-80`` up and by IEEE
  divisions below, where a tiny tensor's encode multipliers are clamped at the fp32 max:
  ``_jit_common.nvfp4_block_scale``);
* columnwise with ``rht``: the kernel computes ``y = T x`` per 16-group from the
  reference's exact products ``x_q · T[p, q]`` with a butterfly summation (fp32), the
  reference with a matmul: equal whenever the fp32 sums are exact (they are for most
  bf16 data), a code may differ where a value sits within an fp32 ulp of a rounding
  boundary (tested with a mismatch bound);
* stochastic rounding takes 8 random bits per element from Philox4x32-10 (``nvfp4.tiles``)
  keyed by the state's int64 kernel key, advanced by one per call on the device
  (``NVFP4State``; CUDA-graph replays draw fresh noise): reproducible for a seeded state,
  not the reference's ``torch.rand`` stream; rounding up has probability
  ``(|v| - lo) / (hi - lo)`` to a multiple of 1/256, bitwise the reference fed the same
  decisions (``tests/_nvfp4_sr_stream.py`` models the stream in torch);
* 2D blocks without RHT: columnwise is the exact transpose of rowwise (codes and scales).
"""

from __future__ import annotations

import torch

from hybrid_dist.formats import traced_rng
from hybrid_dist.formats.numerics import hadamard16
from hybrid_dist.formats.nvfp4 import NV_BLOCK, NVFP4Quantizer, NVFP4State, NVFP4Storage
from hybrid_dist.kernels._jit_common import cdiv, eager_or_op
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._zeros import fresh_f32, zeroed_f32
from hybrid_dist.kernels.nvfp4.tiles import nvfp4_amax_kernel, nvfp4_quantize_kernel
from hybrid_dist.kernels.nvfp4.words import nvfp4_words_kernel, words_lane_quads
from hybrid_dist.kernels.nvfp4.configs import nvfp4_default, nvfp4_words_default
from hybrid_dist.kernels.tile_config import TileConfig, bf16_words
from hybrid_dist.library_op import library_op

_AMAX_TILE = (64, 128)  # [BM, BK] of the amax pass
_AMAX_PROGRAMS_PER_SM = 8


def _amax_programs(device: torch.device, n_tiles: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:  # the Triton interpreter (tests)
        sms = 4
    return max(1, min(n_tiles, sms * _AMAX_PROGRAMS_PER_SM))


def nvfp4_amax_tiles(x: torch.Tensor, rht_row: torch.Tensor, rht: bool, out: torch.Tensor | None = None):
    """fp32 ``[2]``: ``max|x|`` and (if ``rht``) the max of the column-Hadamard transform
    (else 0), reduced into ``out`` (zeros; default a zeroed slot; the op passes ``fresh_f32``:
    see ``kernels._zeros``). ``rht_row``: fp32 ``T[0, :]`` ``[16]``."""
    m, k = x.shape
    out = zeroed_f32(x.device, 2) if out is None else out
    if x.numel():
        bm, bk = _AMAX_TILE
        n_k = cdiv(k, bk)
        n_tiles = cdiv(m, bm) * n_k
        launch(nvfp4_amax_kernel, (_amax_programs(x.device, n_tiles),), x, rht_row, out, m, k, x.stride(0), n_k,
               n_tiles, RHT=rht, BM=bm, BK=bk, num_warps=4)
    return out


def nvfp4_quantize_tiles(
    x: torch.Tensor, rht_row: torch.Tensor, amax: torch.Tensor, seed: torch.Tensor,
    rowwise: bool, columnwise: bool, derive_col: bool, rht: bool, sr: bool, block_rows: int,
    config: TileConfig | None = None, words: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(row_data, row_block_scale, col_data, col_block_scale, row_global_scale,
    col_global_scale)``; absent data empty. ``amax`` fp32: ``[max|x|]``, or ``[max|x|,
    max|RHT(x)|]`` when ``rht`` (the columnwise direction's amax); the global scales are the
    fp32 scalar decode scales the kernel computes from them (``formats.nvfp4.
    nvfp4_global_scale``: no torch ops between the passes). ``seed`` int64 ``[1]``;
    ``rht_row`` fp32 ``T[0, :]``. Needs ``M % 16 == 0`` for columnwise (and 2D blocks).
    ``config``: the tile config (default ``configs.nvfp4_words_default`` for the
    words kernel, else ``configs.nvfp4_default(block_rows)``). ``words``: None picks
    ``nvfp4.words`` for 1×16 blocks from word-readable bf16 (with SR: rowwise only, or
    columnwise only with RHT); False runs the tile kernel there instead (benchmarks and tests
    compare the two)."""
    m, k = x.shape
    if sr and 2 * cdiv(m, NV_BLOCK) * k > 2**32:
        raise ValueError(f"NVFP4 stochastic rounding of a {m}x{k} tensor: its Philox counters "
                         f"(2·⌈M/16⌉·K) would wrap at 2**32; quantize it in row chunks")
    # SR: one direction, a columnwise one with RHT (``nvfp4.words``' note "SR")
    can_words = block_rows == 1 and bf16_words(x) and (not sr or (rowwise != columnwise and (rht or rowwise)))
    if words and not can_words:
        raise ValueError("nvfp4_quantize_tiles(words=True) needs 1x16 blocks, word-readable bf16 and, with SR, "
                         "one direction (a columnwise one with RHT)")
    words = can_words if words is None else words
    config = config or (nvfp4_words_default(rht, rowwise and columnwise, sr) if words else nvfp4_default(block_rows))
    outs = [torch.empty(s, dtype=d, device=x.device) for s, d in _nvfp4_shapes(m, k, rowwise, columnwise, block_rows)]
    gs = [torch.empty((), dtype=torch.float32, device=x.device) for _ in range(2)]
    col64 = (outs[2].view(torch.int64) if columnwise and x.numel()
             else torch.empty(0, dtype=torch.int64, device=x.device))
    grid = (max(cdiv(m, config.bm), 1), max(cdiv(k, config.bk), 1))  # program (0, 0) writes gs even if x is empty
    opts = config.launch_options(x.device)
    # no masks where every tile lies inside x: the words kernel, and the tile kernel's 16x16 blocks
    # (faster); for 1x16 blocks it would raise the tile kernel's registers past 128 and slow it
    even = m * k > 0 and m % config.bm == 0 and k % config.bk == 0
    if words:
        xw = x.view(torch.int32)
        launch(nvfp4_words_kernel, grid, xw, rht_row, amax, seed, outs[0], outs[1], col64, outs[3], *gs, m, k,
               max(xw.stride(0), 1), ROW=rowwise, COL=columnwise, RHT=rht, SR=sr, BM=config.bm, BK=config.bk,
               QUAD=rowwise and columnwise and words_lane_quads(config), EVEN=even, **opts)
    else:
        launch(
            nvfp4_quantize_kernel, grid, x, rht_row, amax, seed, outs[0], outs[1], col64, outs[3], *gs, m, k,
            max(x.stride(0), 1),
            ROW=rowwise, COL=columnwise, DERIVE_COL=derive_col and columnwise, RHT=rht, SR=sr,
            TWO_D=block_rows == NV_BLOCK, BM=config.bm, BK=config.bk, EVEN=even and block_rows == NV_BLOCK, **opts)
    return (*outs, *gs)


def _nvfp4_shapes(m, k, rowwise, columnwise, block_rows):
    br = block_rows
    return [((m, k // 2) if rowwise else (0, 0), torch.uint8),
            ((m // br, k // NV_BLOCK) if rowwise else (0, 0), torch.float8_e4m3fn),
            ((k, m // 2) if columnwise else (0, 0), torch.uint8),
            ((k // br, m // NV_BLOCK) if columnwise else (0, 0), torch.float8_e4m3fn)]


@library_op("hybrid_dist::nvfp4_amax")
def nvfp4_amax_op(x: torch.Tensor, rht_row: torch.Tensor, rht: bool) -> torch.Tensor:
    """fp32 ``[2]``: ``max|x|`` and (if ``rht``) the max of the column-Hadamard transform (else 0)."""
    return nvfp4_amax_tiles(x, rht_row, rht, fresh_f32(x.device, 2))


@nvfp4_amax_op.register_fake
def _(x, rht_row, rht):
    return x.new_empty(2, dtype=torch.float32)


@library_op("hybrid_dist::nvfp4_quantize")
def nvfp4_quantize_op(
    x: torch.Tensor, rht_row: torch.Tensor, amax: torch.Tensor, seed: torch.Tensor,
    rowwise: bool, columnwise: bool, derive_col: bool, rht: bool, sr: bool, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`nvfp4_quantize_tiles` (the default tile config of the block shape)."""
    return nvfp4_quantize_tiles(x, rht_row, amax, seed, rowwise, columnwise, derive_col, rht, sr, block_rows)


@nvfp4_quantize_op.register_fake
def _(x, rht_row, amax, seed, rowwise, columnwise, derive_col, rht, sr, block_rows):
    m, k = x.shape
    outs = [x.new_empty(s, dtype=d) for s, d in _nvfp4_shapes(m, k, rowwise, columnwise, block_rows)]
    return (*outs, x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32))


_RHT_ROW_CACHE: dict[tuple, torch.Tensor] = {}


def _rht_row(seed: int, device: torch.device) -> torch.Tensor:
    """fp32 ``T[0, :]`` ``[16]`` = ``s / 4`` (``T = H16 · diag(s) / 4``; ``H16[0, :] = 1``)."""
    if torch.compiler.is_compiling():  # a traced constant; never stored in the eager cache
        return hadamard16(seed, device)[0].contiguous()
    key = (seed, device)
    if key not in _RHT_ROW_CACHE:
        _RHT_ROW_CACHE[key] = hadamard16(seed, device)[0].contiguous()
    return _RHT_ROW_CACHE[key]


_NO_SEED: dict[torch.device, torch.Tensor] = {}


def _seed_tensor(q: NVFP4Quantizer, state, device, like: torch.Tensor) -> torch.Tensor:
    """int64 ``[1]``: the Philox key the kernel reads. With an ``NVFP4State``, eager: the
    state's live key, which ``quantize_nvfp4`` advances after the launch (stream order: the
    kernel reads it first; a CUDA-graph replay re-runs both); compiled: a copy taken through
    the traced op. Without a state: a draw from the global generator (graph-safe too)."""
    if not q.stochastic_rounding:
        if torch.compiler.is_compiling():
            return torch.zeros(1, dtype=torch.int64, device=device)
        if device not in _NO_SEED:
            _NO_SEED[device] = torch.zeros(1, dtype=torch.int64, device=device)
        return _NO_SEED[device]
    if isinstance(state, NVFP4State):
        if torch.compiler.is_compiling():
            return traced_rng.state_rand(state, like, (1,), draw=2, kind="key")
        return state.kernel_key(device)
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


def quantize_nvfp4(q: NVFP4Quantizer, x2d, *, rowwise, columnwise, state, amax, rht_amax=None,
                   config: TileConfig | None = None):
    """Registry impl for :class:`NVFP4Quantizer` (see module doc for the exactness); any
    float input dtype (the tile kernels build columnwise blocks from 16 row sets, with no
    8-bit transpose). ``rht_amax``: the Hadamard direction's amax (``columnwise_rht_amax``,
    e.g. MAX-reduced over row shards) instead of this tensor's own. ``config``: a tile config
    other than the default (eager only: tests and benchmarks)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    dev = x2d.device
    derive_col = q.block_2d and not q.rht
    col_rht = columnwise and not derive_col and q.rht
    t = _rht_row(q.rht_seed, dev)
    if col_rht and rht_amax is not None:
        first = rht_amax if amax is None else amax
        amaxes = torch.stack([first.float().to(dev).reshape(()), rht_amax.float().to(dev).reshape(())])
    elif amax is None:  # [max|x|, max|RHT(x)| or 0]: what the kernel reads
        amaxes = nvfp4_amax(x2d, t, col_rht)
    elif col_rht:
        amaxes = torch.stack([amax.float().to(dev).reshape(()), nvfp4_amax(x2d, t, True)[1]])
    else:
        amaxes = amax.float().to(dev).reshape(1)
    args = (x2d, t, amaxes, _seed_tensor(q, state, dev, x2d), rowwise, columnwise, derive_col, col_rht,
            q.stochastic_rounding, q.block_rows)
    if config is None:
        row, row_s, col, col_s, gs_row, gs_col = nvfp4_quantize(*args)
    else:
        row, row_s, col, col_s, gs_row, gs_col = nvfp4_quantize_tiles(*args, config)
    if q.stochastic_rounding and isinstance(state, NVFP4State) and not torch.compiler.is_compiling():
        state.advance_kernel_key(dev)
    br = q.block_rows
    row_st = col_st = None
    if rowwise:
        row_st = NVFP4Storage(data=row, block_scale=row_s, global_scale=gs_row, block_rows=br,
                              rht_seed=None, transposed=False)
    if columnwise:
        col_st = NVFP4Storage(data=col, block_scale=col_s, global_scale=gs_col, block_rows=br,
                              rht_seed=q.rht_seed if col_rht else None, transposed=True)
    return row_st, col_st


nvfp4_amax = eager_or_op(nvfp4_amax_op, nvfp4_amax_tiles)


def columnwise_rht_amax_nvfp4(q: NVFP4Quantizer, x2d: torch.Tensor) -> torch.Tensor:
    """Registry impl (``register_rht_amax``): fp32 ``[]``, the amax pass's ``max|RHT(x)|``,
    which ``quantize_nvfp4`` reads when no ``rht_amax`` is given."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    return nvfp4_amax(x2d, _rht_row(q.rht_seed, x2d.device), True)[1]


nvfp4_quantize = eager_or_op(nvfp4_quantize_op, nvfp4_quantize_op.fn)
