"""Summarises loop_probe files: by batch bucket, the host work, wait, process and send a step."""
import json, sys, glob
BUCKETS = [(1, 1), (2, 8), (9, 32), (33, 64), (65, 128), (129, 256)]
for path in sys.argv[1:]:
    rows = json.load(open(path))
    # keep the last generate/serving run: rows after the last gap > 2 s
    start = 0
    for i in range(1, len(rows)):
        if rows[i][0] - (rows[i - 1][0] + rows[i - 1][1]) > 2.0:
            start = i
    rows = rows[start:]
    span = rows[-1][0] + rows[-1][1] - rows[0][0]
    print(f"{path}: {len(rows)} steps over {span:.3f} s; waited {sum(r[2] for r in rows):.3f} s, "
          f"step host {sum(r[1] - r[2] for r in rows):.3f} s, process {sum(r[4] for r in rows):.3f} s, "
          f"send {sum(r[5] for r in rows):.3f} s")
    print("  outputs   steps  host ms  wait ms  process ms  send ms  iteration ms")
    for lo, hi in BUCKETS:
        sel = [(i, r) for i, r in enumerate(rows) if lo <= r[3] <= hi and i + 1 < len(rows)]
        if not sel:
            continue
        n = len(sel)
        it = sum(rows[i + 1][0] - r[0] for i, r in sel) / n
        print(f"  {lo:>3}-{hi:<4} {n:>6} {1e3*sum(r[1]-r[2] for _, r in sel)/n:8.3f} {1e3*sum(r[2] for _, r in sel)/n:8.3f}"
              f" {1e3*sum(r[4] for _, r in sel)/n:11.3f} {1e3*sum(r[5] for _, r in sel)/n:8.3f} {1e3*it:13.3f}")
