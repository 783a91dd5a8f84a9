"""Nsight Compute on one kernel launch at the bench shape (B=8, T=4096, H=16, K=V=128, bf16): where its time goes.

    python3 tools/gpu/ncu.py profile NAME SIDE REGEX OUT         ncu on the first launch of a kernel whose name
                                                                 matches REGEX after a warm-up call: the summary
                                                                 sections (occupancy, issue rate, registers) in
                                                                 OUT/ncu-LABEL.txt and the SASS source page in
                                                                 OUT/ncu-LABEL-sass.csv, with its digest printed
    python3 tools/gpu/ncu.py digest FILE.csv [N]                 that digest again: executed instructions by opcode
                                                                 and the lines with the most stall samples
    python3 tools/gpu/ncu.py lines FILE-lines.csv [N]            the Python source lines (Triton's line info; the
                                                                 page profile also saves, OUT/ncu-LABEL-lines.csv)
                                                                 with the most stall samples, each with its share of
                                                                 the kernel's samples and its three main stall reasons
    python3 tools/gpu/ncu.py call NAME SIDE                      (what ncu runs) the warm-up call and the profiled one

SIDE is ours, peer, or ours-backward (the bench's training step, forward and backward, for the backward's
launches). LABEL is NAME-SIDE-REGEX. Used in session 6 on the delta rules' three passes and fla's (bash tools/gpu/job ncu).
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats", "InstructionStats",
            "SourceCounters"]
SUMMARY = re.compile(r"Duration|Registers Per|Achieved Occupancy|Issued Warp Per Scheduler|No Eligible|Executed Instructions  "
                     r"|Theoretical Occupancy|Memory Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued|Grid Size")


def call(name: str, side: str) -> None:
    import torch

    import attnlab
    from attnlab.commands.bench import forward_backward, peer_call, peer_inputs

    f = attnlab.formulation(name)
    x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
    inputs = peer_inputs(name, x)
    ours = attnlab.kernel(name, "chunkwise")
    if side == "peer":
        run = peer_call(name, x)
    elif side == "ours-backward":
        leaves = [t.requires_grad_() for n, t in inputs.items()
                  if isinstance(t, torch.Tensor) and f.arg(n).differentiable]
        run = forward_backward(lambda: ours(**inputs), leaves)
    else:
        run = lambda: ours(**inputs)  # noqa: E731
    for _ in range(2):
        run()
    torch.cuda.synchronize()


def digest(path: str, count: int | str = 20) -> None:
    count = int(count)  # from the command line, a string
    text = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith('"Address"'))  # after the "Kernel Name" line
    rows = list(csv.DictReader(text[start:]))
    number = lambda row, key: float((row.get(key) or "0").replace(",", "") or 0)  # noqa: E731
    executed, stalls = "Instructions Executed", "Warp Stall Sampling (All Samples)"
    total = sum(number(r, executed) for r in rows) or 1.0
    by_op, stall_op = Counter(), Counter()
    for row in rows:
        words = row["Source"].split()
        op = (words[1] if words and words[0].startswith("@") else words[0] if words else "?").split(".")[0]
        by_op[op] += number(row, executed)
        stall_op[op] += number(row, stalls)
    print(f"{total:.3e} instructions executed")
    for op, n in by_op.most_common(count):
        print(f"  {op:10s} {100 * n / total:5.1f}%   stall samples {stall_op[op]:.0f}")
    print("lines with the most stall samples:")
    for row in sorted(rows, key=lambda r: -number(r, stalls))[:count]:
        print(f"  {number(row, executed):10.0f} {number(row, stalls):7.0f}  {row['Source'].strip()[:100]}")


def lines(path: str, count: int | str = 25) -> None:
    """The source page printed as "cuda,sass": a "File Path" row opens each file's block, a "Line No" row gives the
    columns, a row with a line number is that line's total (the SASS rows under it, without one, are skipped)."""
    totals, header, file = [], None, "?"
    for row in csv.reader(Path(path).read_text().splitlines()):
        if len(row) == 2 and row[0] == "File Path":
            file = Path(row[1]).name
        elif row and row[0] == "Line No":
            header = row
        elif header and len(row) == len(header) and row[0]:
            fields = dict(zip(header, row))
            try:
                samples = float(fields["Warp Stall Sampling (All Samples)"].replace(",", "") or 0)
                reasons = {name.removeprefix("stall_"): float(value.replace(",", "") or 0)
                           for name, value in zip(header, row) if name.startswith("stall_") and "Not Issued" not in name}
            except ValueError:  # a source line whose quotes the CSV writer left unbalanced
                continue
            totals.append((samples, f"{file}:{row[0]}", row[1].strip()[:90], reasons))
    everything = sum(t[0] for t in totals) or 1.0
    print(f"{everything:.0f} stall samples")
    for samples, where, text, reasons in sorted(totals, key=lambda t: -t[0])[:int(count)]:
        main = sorted(reasons.items(), key=lambda item: -item[1])[:3]
        why = " ".join(f"{name} {100 * n / max(samples, 1):.0f}%" for name, n in main)
        print(f"  {100 * samples / everything:5.1f}%  {where:28s} {text}  [{why}]")


def profile(name: str, side: str, regex: str, out: str) -> None:
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}-{side}-{regex}")
    report = f"/tmp/{label}"
    command = ["ncu", "--clock-control", "none", *[a for s in SECTIONS for a in ("--section", s)], "-k", f"regex:{regex}",
               "--launch-skip", "1", "--launch-count", "1", "-f", "-o", report, sys.executable, __file__, "call", name, side]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode:
        print(done.stdout[-2000:], done.stderr[-2000:])
        return
    details = subprocess.run(["ncu", "-i", f"{report}.ncu-rep"], capture_output=True, text=True).stdout
    Path(out, f"ncu-{label}.txt").write_text(details)
    source = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                            capture_output=True, text=True).stdout
    Path(out, f"ncu-{label}-sass.csv").write_text(source)
    source_lines = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source",
                                   "cuda,sass"], capture_output=True, text=True).stdout
    Path(out, f"ncu-{label}-lines.csv").write_text(source_lines)
    print(f"== {label}")
    print("\n".join(" ".join(line.split()) for line in details.splitlines() if SUMMARY.search(line)))
    digest(str(Path(out, f"ncu-{label}-sass.csv")), count=12)
    lines(str(Path(out, f"ncu-{label}-lines.csv")), 12)


if __name__ == "__main__":
    verb, *args = sys.argv[1:]
    {"call": call, "digest": digest, "lines": lines, "profile": profile}[verb](*args)
