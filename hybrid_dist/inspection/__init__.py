"""Per-tensor quantization statistics: what each GEMM operand loses in its format.

``StatsCollector(model)`` attaches a statistics buffer to every ``hd.Linear`` and
``GroupedLinear`` plan (MoE experts: one row set per module, the experts combined, on
every path);
inside ``collector.capture()`` (a logging step) each GEMM function records, for every
operand (input, weight, grad_output) and direction it uses, the amax, the SQNR of the
quantized tensor against the high-precision one, the fraction of nonzero values flushed
to zero, the fraction saturated and a histogram of block scales, for the recipe's format
and for candidate formats (MXFP8, NVFP4). Outside a capture nothing runs.
"""

from hybrid_dist.inspection.candidates import CANDIDATES, GEMM_OF, format_label
from hybrid_dist.inspection.capture import ModuleStats, active_stats, capturing, is_capturing
from hybrid_dist.inspection.collector import StatsCollector, clean_fqn
from hybrid_dist.inspection.stats import FIELDS, HIST_BINS, HIST_LO, WIDTH, block_scales, combine_stats, decode, quant_stats

__all__ = [
    "CANDIDATES", "FIELDS", "GEMM_OF", "HIST_BINS", "HIST_LO", "ModuleStats", "StatsCollector", "WIDTH",
    "active_stats", "block_scales", "capturing", "clean_fqn", "combine_stats", "decode", "format_label",
    "is_capturing", "quant_stats",
]
