"""One table from an Nsight Compute raw CSV: per profiled kernel, time, registers, occupancy
and the top stall reasons (warps stalled per issued instruction).

    ncu --clock-control none --kernel-name-base function --kernel-name regex:"<kernels>" \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --csv --page raw \
        python -m benchmarks.quantize --once > ncu.csv 2> cases.txt
    python -m benchmarks.ncu_summary ncu.csv cases.txt

``cases.txt``: the program's ``CASE <name>`` lines (stderr), one per profiled launch, in order.
A memory-bound kernel shows ``long_scoreboard`` (waiting on DRAM) far ahead; an issue-bound
one shows few stalls per instruction and ``short_scoreboard`` / ``mio_throttle`` (shared
memory) or ``wait`` / ``not_selected`` near the top."""
import csv
import re
import sys

rows = list(csv.reader(open(sys.argv[1])))
start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
head, data = rows[start], rows[start + 2:]
names = [ln.split("CASE ", 1)[1].strip() for ln in open(sys.argv[2]) if ln.startswith("CASE ")]
col = {h: i for i, h in enumerate(head)}
WANT = [("ns", "gpu__time_duration.sum"), ("dram %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
        ("regs", "launch__registers_per_thread"), ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
        ("issue active %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
        ("warp instructions", "inst_executed"), ("smem B/block", "launch__shared_mem_per_block_dynamic")]
stall_cols = [(m.group(1), i) for h, i in col.items()
              if (m := re.match(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$", h))]
print("| kernel | grid | block | " + " | ".join(w for w, _ in WANT) + " | top stalls (warps per issue) |")
for n, r in enumerate(data):
    name = names[n] if n < len(names) else r[col.get("Kernel Name", 4)]
    vals = []
    for _, m in WANT:
        v = r[col[m]] if m in col else "?"
        vals.append(v)
    st = []
    for s, i in stall_cols:
        try:
            st.append((float(r[i].replace(",", "")), s))
        except ValueError:
            pass
    st.sort(reverse=True)
    grid = r[col["Grid Size"]] if "Grid Size" in col else "?"
    block = r[col["Block Size"]] if "Block Size" in col else "?"
    print(f"| {name} | {grid} | {block} | " + " | ".join(vals) + " | "
          + ", ".join(f"{s} {v:.2f}" for v, s in st[:5]) + " |")
