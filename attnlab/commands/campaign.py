"""The fla 0.6.0 campaign (issue 6): ``attnlab validate`` on every fla kernel attnlab knows the convention of.

    python3 .ci/gpu_campaign.py run OUT [--budget 400] [--jobs 10] [--examples 6] [--ops chunk_gla,...]
    python3 .ci/gpu_campaign.py render OUT [--out reports/third_party/fla-0.6.0.md]

``run`` (on the GPU, fla importable) starts one ``attnlab validate`` per
(kernel, dtype) in bf16 and fp16, both strategies (default and adversarial),
in parallel subprocesses (compiling and autotuning fla's Triton kernels is
CPU-bound), each into ``OUT/<op>-<dtype>/`` (report.json, summary.md, curve/,
log.txt), and writes ``OUT/campaign.json``. Everything is bounded by
``--budget`` seconds, shared fairly: the jobs run in waves of ``--jobs``, and
every job gets the same slot, budget / waves (the first run spent the budget
on the first jobs, and half never started); within it ``attnlab validate``
measures the curve first (``--curve-first``), then stops starting searches
``SLOT_MARGIN`` seconds before the slot ends, and is killed at the slot's end
(plus ``KILL_GRACE``). The bf16 and fp16 jobs of a kernel are adjacent and the
slow-compiling chunked kernels go first. Head dims are fixed at 64 and heads at
most 2 (fla autotunes per K, V and H), T up to 1024; the curve runs
T = 64..4096 at B=1, H=2, K=V=64 beside attnlab's own kernels and the naive
recurrences (the gallery has the long curves: the naive same-dtype recurrences
are Python loops, and T = 16384 cost chunk_gla and chunk_kda their curve).

``render`` (anywhere, from the fetched OUT) writes the Markdown report: per
kernel, the excess by length (fla beside attnlab), every property that
failed with its minimal counterexample, each classified (``classify``: bug,
rounding on an exactly representable output, accuracy finding, does not
apply), and for the bugs alone a standalone script reproducing them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# (formulation, fla op), in FORMULATIONS.md's order: the kernels of issue 6.
KERNELS = (
    ("softmax", "parallel_attn"),
    ("linear_attn", "chunk_linear_attn"),
    ("linear_attn", "fused_recurrent_linear_attn"),
    ("retnet", "chunk_retention"),
    ("retnet", "chunk_simple_gla"),
    ("gla", "chunk_gla"),
    ("gla", "fused_recurrent_gla"),
    ("rwkv4", "fused_recurrent_rwkv4"),
    ("deltanet", "chunk_delta_rule"),
    ("deltanet", "fused_recurrent_delta_rule"),
    ("gated_deltanet", "chunk_gated_delta_rule"),
    ("gated_deltanet", "fused_recurrent_gated_delta_rule"),
    ("kda", "chunk_kda"),
    ("kda", "fused_recurrent_kda"),
)
DTYPES = ("bfloat16", "float16")
LENGTHS = "64,256,1024,4096"
CURVE_SHAPE = "1,2,64,64"
# Seconds kept at the end of a job's slot: a search started just before the --time-budget runs on into it, and
# the report is written after it.
SLOT_MARGIN = 25
# Seconds a job may run past its slot before it is killed (a killed job writes no report).
KILL_GRACE = 10
# The order of the jobs: these compile and autotune the most Triton kernels (slowest first).
SLOW_FIRST = ("chunk_gla", "chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule", "chunk_retention",
              "chunk_simple_gla", "chunk_linear_attn")


def job_order(ops: list[tuple[str, str]], dtypes: list[str]) -> list[tuple[str, str, str]]:
    """Every (formulation, op, dtype), slow ops first, the dtypes of one op adjacent."""
    rank = {op: i for i, op in enumerate(SLOW_FIRST)}
    ordered = sorted(ops, key=lambda k: (rank.get(k[1], len(rank)), KERNELS.index(k) if k in KERNELS else 0))
    return [(name, op, dtype) for name, op in ordered for dtype in dtypes]


def slot_seconds(budget: float, jobs: int, count: int) -> float:
    """Each job's share of the budget: the jobs run in ceil(count / jobs) waves of ``jobs``."""
    waves = max(1, -(-count // max(1, jobs)))
    return (budget - KILL_GRACE) / waves


def job_command(name: str, op: str, dtype: str, out: Path, examples: int, time_budget: float) -> list[str]:
    return [sys.executable, "-m", "attnlab.cli", "validate", "--fla-op", op, "--formulation", name,
            "--device", "cuda", "--dtype", dtype, "--strategy", "both", "--examples", str(examples),
            "--dims", "64", "--max-T", "1024", "--max-H", "2", "--max-B", "2", "--minimize", "12",
            "--lengths", LENGTHS, "--curve-shape", CURVE_SHAPE, "--curve-first", "--time-budget", f"{time_budget:.0f}",
            "--out", str(out), "--no-progress"]


def run_campaign(out: Path, budget: float, jobs: int, examples: int, ops: list[str] | None, dtypes: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + budget
    work = job_order([(name, op) for name, op in KERNELS if ops is None or op in ops], dtypes)
    slot = slot_seconds(budget, jobs, len(work))
    records: dict[str, dict[str, Any]] = {}
    print(f"campaign: {len(work)} jobs, {jobs} at a time, {slot:.0f} s each (budget {budget:.0f} s)", flush=True)

    def one(job: tuple[str, str, str]) -> None:
        name, op, dtype = job
        key = f"{op}-{dtype}"
        folder = out / key
        folder.mkdir(parents=True, exist_ok=True)
        left = min(slot + KILL_GRACE, deadline + KILL_GRACE - time.time())
        record: dict[str, Any] = {"formulation": name, "op": op, "dtype": dtype, "folder": key, "slot_s": round(slot)}
        if left < 30:
            record.update(status="not started", detail=f"campaign budget of {budget:.0f} s spent")
            records[key] = record
            return
        command = job_command(name, op, dtype, folder, examples, max(10.0, min(slot, left) - SLOT_MARGIN))
        record["command"] = " ".join(shlex.quote(c) for c in command[1:]).replace("-m attnlab.cli", "attnlab", 1)
        started = time.time()
        with open(folder / "log.txt", "w") as log:
            try:
                rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=left, check=False).returncode
                record.update(status={0: "held", 1: "failed"}.get(rc, "error"), rc=rc)
            except subprocess.TimeoutExpired:
                record.update(status="timed out", rc=None, detail=f"killed after {left:.0f} s (its slot)")
        record["seconds"] = round(time.time() - started, 1)
        records[key] = record
        print(f"{key}: {record['status']} ({record['seconds']} s)", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, work))
    summary = {"what": "attnlab validate on flash-linear-attention 0.6.0's kernels (issue 6)", "budget_s": budget,
               "slot_s": round(slot), "jobs": jobs, "examples": examples, "lengths": LENGTHS, "curve_shape": CURVE_SHAPE,
               "env": {k: os.environ.get(k) for k in ("FLA_DISABLE_BACKEND_DISPATCH", "FLA_TRIL_PRECISION", "FLA_USE_FAST_OPS")},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start)),
               "records": [records[f"{op}-{dtype}"] for name, op, dtype in work if f"{op}-{dtype}" in records]}
    (out / "campaign.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"campaign: {len(records)} jobs, " + ", ".join(
        f"{sum(r['status'] == s for r in records.values())} {s}" for s in ("held", "failed", "error", "timed out", "not started")))
    return 0


# ----------------------------------------------------------------------------- render

# Properties that are identities (any correct implementation keeps them, up to rounding), not accuracy bounds.
IDENTITIES = {"causality", "split_and_resume", "chunk_size_invariance", "reduces_to_special_case", "convexity",
              "shift_invariance"}
# An excess at least this many times the bound is a bug wherever it shows; below ACCURACY_RATIO on the default
# inputs it is an accuracy finding ("less accurate than the bound").
BUG_RATIO = 10.0
ACCURACY_RATIO = 4.0
EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}


def _number(detail: str, key: str) -> float | None:
    match = re.search(rf"{key}\s+([-+0-9.eE]+|inf|nan)", detail or "")
    try:
        return float(match.group(1)) if match else None
    except ValueError:
        return None


def classify(v: dict[str, Any], who: str = "the kernel") -> tuple[str, str]:
    """(kind, why) of a failed or erroring verdict; kind is "bug", "representable", "accuracy", "limitation" or "error".

    bug: the kernel raised, returned NaN/inf where the oracle is finite, broke an identity (causality; a
    split-and-resumed final state, convexity or another identity by ACCURACY_RATIO times its rounding allowance or more) or
    missed the bound by 10x or more. representable: the exact output is representable in the dtype (floor_round
    0), so any rounding at all shows as an unbounded excess. accuracy: past the bound by less (on the default
    inputs below 4x: "less accurate than the bound"). limitation: a property that cannot apply to this kernel
    (its state omits a part the run needs). error: attnlab's check itself failed (not a finding about the kernel).
    """
    detail, measure = v.get("detail") or "", v.get("measure") or ""
    if v["status"] == "error":
        return "error", "the check could not run (attnlab's side): " + detail.splitlines()[0][:200] if detail else "the check could not run"
    if "raised" in measure:
        return "bug", "the kernel raised on a valid input"
    if measure == "state parts carried":
        return "limitation", detail.split("; split at")[0]
    figure, bound = v.get("figure"), v.get("bound")
    if figure is None:
        return "bug", "non-finite output where the float64 oracle is finite"
    ratio = figure / bound if bound else math.inf
    if v["property"] == "causality":
        return "bug", "causality is an identity every correct implementation keeps (an output moved when only later inputs changed)"
    if v["property"] == "split_and_resume" and "state" in measure:
        if ratio >= ACCURACY_RATIO:
            return "bug", f"the split-and-resumed final state differs from the oracle's by {ratio:.3g}x the rounding allowance ({figure:.3g} > {bound:.3g} relative)"
        return "accuracy", f"the split-and-resumed final state is off by {ratio:.3g}x the rounding allowance ({figure:.3g} > {bound:.3g} relative)"
    if v["property"] in IDENTITIES and "excess" not in measure:
        if ratio >= ACCURACY_RATIO:
            return "bug", f"{v['property']} is an identity, broken by {ratio:.3g}x its rounding allowance"
        return "accuracy", f"{v['property']} is kept only up to {ratio:.3g}x its rounding allowance (a few ulps): less accurate than the bound"
    floor_round = _number(detail, "floor_round")
    if floor_round == 0.0 and "excess" in measure:
        eps = EPS.get(v["dtype"], 2.0**-7)
        ulps = re.search(r"off by up to ([0-9.eE+-]+) ulps", detail)
        if ulps:
            off = f"off by up to {float(ulps.group(1)):.3g} ulps"
        else:
            rel, max_err = _number(detail, "rel_err"), _number(detail, "max_err")
            off = (f"off by {rel / eps:.2g} ulps norm-wise (rel_err {rel:.3g}, max_err {max_err:.3g})"
                   if rel is not None and max_err is not None else "off by a few ulps")
        return "representable", f"the exact output is representable in {v['dtype']}, so any rounding shows; {who} is {off}"
    if ratio >= BUG_RATIO:
        return "bug", f"{ratio:.3g}x the bound ({figure:.3g} > {bound:.3g})"
    if v["strategy"] == "default":
        if ratio < ACCURACY_RATIO:
            return "accuracy", f"less accurate than the bound on the default inputs ({figure:.3g} vs {bound:.3g}, {ratio:.2g}x)"
        return "accuracy", f"well past the bound on the default inputs ({ratio:.3g}x; below the {BUG_RATIO:g}x taken for a bug)"
    return "accuracy", f"past the bound on adversarial inputs ({ratio:.3g}x)"


def looks_like_bug(v: dict[str, Any]) -> str:
    """Why a failure is a bug ('' when it is not one: an accuracy finding, a limitation or attnlab's error)."""
    if v["status"] != "failed":
        return ""
    kind, why = classify(v)
    return why if kind == "bug" else ""


KIND_WORDS = {"bug": "Bug", "representable": "Rounding on an exactly representable output",
              "accuracy": "Accuracy finding", "limitation": "Does not apply", "error": "attnlab's check failed"}


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(esc(c) for c in r) + " |" for r in rows)]


def _excess_text(rows: list[dict[str, Any]], impl: str) -> str:
    values = [r["excess"] for r in rows if r["impl"] == impl and r.get("excess") is not None]
    broken = [r for r in rows if r["impl"] == impl and (r.get("error") or r.get("excess") is None)]
    text = f"{max(values):.3g}" if values else "-"
    return text + (f" ({len(broken)} point(s) failed)" if broken else "")


def _plain_summary_table(rows: list[dict[str, Any]]) -> list[str]:
    """attnlab.commands.report.summary_table's table, torch-free: the excess at each T and the worst rel_err."""
    lengths = sorted({r["T"] for r in rows})
    body = []
    for key in dict.fromkeys((r["formulation"], r["impl"], r["dtype"]) for r in rows):
        mine = {r["T"]: r for r in rows if (r["formulation"], r["impl"], r["dtype"]) == key}
        cell = lambda r: ("-" if r is None else "error" if r.get("error") else  # noqa: E731
                          "non-finite" if r.get("excess") is None else f"{r['excess']:.3g}")
        errors = [r["rel_err"] for r in mine.values() if r.get("rel_err") is not None]
        body.append([key[0], f"`{key[1]}`", key[2], *[cell(mine.get(T)) for T in lengths],
                     f"{max(errors):.3g}" if errors else "-"])
    return _md_table(["formulation", "impl", "dtype", *[f"T={T}" for T in lengths], "worst rel_err"], body)


def render(results: Path, target: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        from attnlab.commands.report import summary_table
    except ImportError:  # no torch here (attnlab imports it): the same table without the growth column
        summary_table = _plain_summary_table

    campaign = json.loads((results / "campaign.json").read_text()) if (results / "campaign.json").exists() else {"records": []}
    records = campaign["records"] or [{"folder": p.name, "op": p.name.rsplit("-", 1)[0], "dtype": p.name.rsplit("-", 1)[1],
                                       "status": "?"} for p in sorted(results.iterdir()) if (p / "report.json").exists()]
    reports: dict[str, dict[str, Any]] = {}
    for r in records:
        path = results / r["folder"] / "report.json"
        if path.exists():
            reports[r["folder"]] = json.loads(path.read_text())
            r.setdefault("formulation", reports[r["folder"]]["formulation"])
    first = next(iter(reports.values()), None)
    lines = ["# flash-linear-attention 0.6.0 under `attnlab validate`", ""]
    if first:
        env = ", ".join(f"{k}={'unset' if v is None else v}" for k, v in first["env"].items())
        lines += [f"- Device: {first['device']['name']}",
                  "- Versions: " + ", ".join(f"{k} {v}" for k, v in first["versions"].items()),
                  f"- Environment (changes fla's numerics): {env}",
                  f"- Search: {first['examples']} examples per (property, strategy, dtype), derandomized, sizes "
                  f"{first['sizes']}, head dims 64; failures minimized greedily (at most 12 checks).",
                  f"- Curve: T = {campaign.get('lengths', LENGTHS)}, shape B,H,K,V = {campaign.get('curve_shape', CURVE_SHAPE)}, "
                  "the registry's default inputs (seed 0), against the float64 oracle.",
                  f"- Campaign: `python3 .ci/gpu_campaign.py run OUT` (budget {campaign.get('budget_s', '?')} s, "
                  f"{campaign.get('jobs', '?')} parallel jobs), rendered by `python3 .ci/gpu_campaign.py render OUT`; "
                  f"started {campaign.get('started', '?')}.", ""]
    lines += [
        "Each kernel is called in its own convention (attnlab.conventions.FLA: fla's keywords, log gates, "
        "`(o, final_state)` with `output_final_state`, fp32 states, RWKV-4's `log w` and `[B, 3, 1, C]` state, "
        "linear attention's feature map applied outside) through the adapter, so that attnlab's oracles and "
        "properties apply unchanged. *default*: the registry's default input distributions; *adversarial*: gates "
        "down to -20 per step, beta at 0 and 2, nearly parallel keys, logits and keys past the dtype's exp "
        "overflow. Bounds: excess = rel_err / floor <= 1.5 (bf16), 2 (fp16); final states 2^-7 (bf16), 2^-10 "
        "(fp16) relative; causality bitwise (attnlab.properties.checks).", "",
        "## Summary", ""]
    body = []
    for r in records:
        rep = reports.get(r["folder"])
        if rep is None:
            body.append([r.get("formulation", "?"), f"`{r['op']}`", r["dtype"], r["status"], "", "", "", r.get("detail", "")])
            continue
        verdicts = rep["verdicts"]
        by = {s: [v for v in verdicts if v["strategy"] == s] for s in ("default", "adversarial")}
        cell = lambda vs: ("-" if not vs else "held" if all(v["held"] for v in vs) else  # noqa: E731
                           ", ".join(f"{n} {label}" for label, n in (
                               ("held", sum(v["status"] == "held" for v in vs)),
                               ("failed", sum(v["status"] in ("failed", "error") for v in vs)),
                               ("not run", sum(v["status"] in ("skipped", "not run") for v in vs))) if n))
        rows = rep["curve"].get("rows", [])
        failed = sorted({v["property"] for v in verdicts if v["status"] == "failed"})
        own = sorted({x["impl"] for x in rows if x["impl"].startswith("attnlab:")})
        body.append([rep["formulation"], f"`{r['op']}`", r["dtype"], cell(by["default"]), cell(by["adversarial"]),
                     _excess_text(rows, rep["kernel"]), ", ".join(f"{i.split(':')[1]} {_excess_text(rows, i)}" for i in own),
                     ", ".join(failed) + (f"; job {r['status']}" if r["status"] in ("timed out", "error") else "")])
    lines += _md_table(["formulation", "fla kernel", "dtype", "default", "adversarial", "worst curve excess (fla)",
                        "worst curve excess (attnlab)", "failed properties"], body)
    lines += ["", "Worst curve excess: the largest excess over T of the error-vs-length curve below.", ""]
    bugs: list[tuple[str, dict[str, Any], str, str]] = []
    for name, op in KERNELS:
        mine = [r for r in records if r["op"] == op and r.get("formulation", name) == name]
        if not mine:
            continue
        lines += [f"## {name}: `{op}`", ""]
        reps = [(r, reports.get(r["folder"])) for r in mine]
        present = [rep for _, rep in reps if rep is not None]
        if present:
            convention = present[0]["convention"]
            lines += [f"Convention: {convention['describe'] if convention else 'none'}", ""]
            if convention and convention.get("derived"):
                lines += [f"Note: this kernel computes {', '.join(convention['derived'])} itself (in fp32), while the "
                          "oracle sees the registry's value rounded to the dtype: part of a small excess can be that "
                          "rounding, not the kernel.", ""]
        for r, rep in reps:
            if rep is None:
                lines += [f"- {r['dtype']}: {r['status']} {r.get('detail', '')}".rstrip(), ""]
        rows = [x for rep in present for x in rep["curve"].get("rows", [])]
        if rows:
            lines += ["### Excess by length", "", *summary_table(rows), ""]
        verdicts = [(rep, v) for rep in present for v in rep["verdicts"]]
        if verdicts:
            lines += ["### Properties", "", *_md_table(
                ["strategy", "dtype", "property", "verdict", "examples", "worst figure / bound", "input"],
                [[v["strategy"], v["dtype"], v["property"], {"held": "held", "failed": "**FAILED**", "error": "ERROR",
                  "skipped": "not run"}[v["status"]], str(v["examples"]), v["figure_text"], f"`{v['case']}`" if v["case"] else v["detail"][:120]]
                 for _, v in verdicts]), ""]
        failures = [(rep, v) for rep, v in verdicts if v["status"] in ("failed", "error")]
        if failures:
            lines += ["### Failures", ""]
            for rep, v in failures:
                kind, reason = classify(v, "fla" if rep["kernel"].startswith("fla") else "the kernel")
                why = reason if kind == "bug" and v["status"] == "failed" else ""
                lines += [f"- **{v['property']}** ({v['strategy']}, {v['dtype']}): {v['figure_text'] or v['status']}; "
                          f"minimal counterexample `{v['case']}`" + (f" (found as `{v['found']}`)" if v.get("found") and v["found"] != v["case"] else "")
                          + f". {KIND_WORDS[kind]}: {reason}.",
                          f"  - {v['detail'][:400]}" if v.get("detail") else ""]
                key = f"{v['strategy']}/{v['dtype']}/{v['property']}"
                if why and key in rep.get("repro", {}) and not any(t.startswith(f"{op}: {v['property']} ") for t, *_ in bugs):
                    bugs.append((f"{op}: {v['property']} ({v['strategy']}, {v['dtype']})", v, rep["repro"][key], why))
            lines.append("")
    if bugs:
        lines += ["## Reproducing the bugs", "",
                  "Each script runs on a CUDA machine with fla-core 0.6.0 and attnlab installed; it calls fla's kernel "
                  "through its declared convention (attnlab.conventions.FLA) on the minimal counterexample and prints "
                  "the check's report.", ""]
        for title, v, script, why in bugs:
            lines += [f"### {title}", "", f"{why}.", "", "```python", script.rstrip(), "```", ""]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(line for line in lines if line is not None).rstrip() + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run validate on every fla kernel (GPU)")
    run.add_argument("out", type=Path)
    run.add_argument("--budget", type=float, default=400.0, help="seconds for the whole campaign (default 400)")
    run.add_argument("--jobs", type=int, default=10, help="validate processes at a time (default 10)")
    run.add_argument("--examples", type=int, default=6, help="examples per property, strategy and dtype (default 6)")
    run.add_argument("--ops", default=None, help="comma-separated fla ops (default: all 14)")
    run.add_argument("--dtypes", default=",".join(DTYPES), help="default bfloat16,float16")
    draw = sub.add_parser("render", help="write the Markdown report from a run's folder")
    draw.add_argument("results", type=Path)
    draw.add_argument("--out", type=Path, default=Path("reports/third_party/fla-0.6.0.md"))
    args = parser.parse_args(argv)
    if args.command == "run":
        ops = [o.strip() for o in args.ops.split(",")] if args.ops else None
        return run_campaign(args.out, args.budget, args.jobs, args.examples, ops, [d.strip() for d in args.dtypes.split(",")])
    print(f"wrote {render(args.results, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
