"""Summarise Nsight Compute source pages (`ncu --page source --print-source sass --csv`,
as scripts/ncu.sh writes them): per kernel, warp stall samples by reason and by
opcode, executed instructions by opcode, instructions with shared-memory conflicts or
excessive global sectors, and the instructions with the most stall samples.

    python scripts/ncu_source.py FILE.src.csv [kernel-name substring] [top N]

Stall samples count every warp, the load and dQ warps too (their waits show as
long-scoreboard stalls on the mbarrier polling branches).
"""

import collections
import csv
import sys


def kernels(path):
    """(kernel name, header, rows as dicts) for each kernel in the CSV."""
    name, header, rows = None, None, []
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if rec and rec[0] == "Kernel Name":
                if name:
                    yield name, header, rows
                name, header, rows = rec[1], None, []
            elif header is None:
                header = rec
            else:
                rows.append(dict(zip(header, rec)))
    if name:
        yield name, header, rows


def num(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(source):
    words = source.split()
    if not words:
        return ""
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def summarise(name, header, rows, top):
    samples_key = "Warp Stall Sampling (All Samples)"
    total = sum(num(r[samples_key]) for r in rows) or 1.0
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    by_reason = {k: sum(num(r[k]) for r in rows) for k in reasons}
    print(f"=== {name[:100]} ({len(rows)} instructions, {total:.0f} samples)")
    print("stall reasons: " + ", ".join(
        f"{k[6:]} {v / total:.1%}" for k, v in sorted(by_reason.items(), key=lambda x: -x[1])[:10]))
    executed, sampled = collections.Counter(), collections.Counter()
    for r in rows:
        op = opcode(r["Source"])
        executed[op] += num(r["Instructions Executed"])
        sampled[op] += num(r[samples_key])
    print("executed: " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in executed.most_common(16)))
    print("samples:  " + ", ".join(f"{k} {v / total:.1%}" for k, v in sampled.most_common(14)))
    for r in rows:
        ways = num(r.get("L1 Conflicts Shared N-Way", "0"))
        if ways > 1 and not r["Source"].strip().startswith("HGMMA"):
            src = r["Source"].strip()[:70]
            print(f"  shared {ways:.0f}-way  x{r['Instructions Executed']}  {src}")
    excess = [r for r in rows if num(r.get("L2 Theoretical Sectors Global Excessive", "0")) > 0]
    if excess:
        print(f"  {len(excess)} instructions with excessive global sectors, e.g. "
              f"{excess[0]['Source'].strip()[:60]}")
    for r in sorted(rows, key=lambda r: -num(r[samples_key]))[:top]:
        s = num(r[samples_key])
        why = sorted(((num(r[k]), k[6:]) for k in reasons), reverse=True)[:3]
        print(f"{s / total:6.1%} {r['Address'][-5:]} {r['Source'].strip()[:64]:64s} "
              + " ".join(f"{k}:{v:.0f}" for v, k in why if v > 0))


def main():
    path = sys.argv[1]
    pattern = sys.argv[2] if len(sys.argv) > 2 else ""
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    for name, header, rows in kernels(path):
        if pattern in name:
            summarise(name, header, rows, top)


if __name__ == "__main__":
    main()
