"""``attnlab campaign``: ``attnlab validate`` on every kernel of a third-party library, rendered as one report.

    attnlab campaign fla [--budget 400] [--jobs 10] [--examples 6] [--ops chunk_gla,...] [--strict] [--out DIR]
    attnlab campaign --render DIR [--report PATH] [--strict]   (re-render fetched results; no GPU)

A target is a library the registry's peers name (``Peer.library``) that has a
campaign (``TARGETS``: fla). Its kernels are every registry entry's peers of
that library, in registry order; the job list never names a formulation.

Running (on the GPU, the library importable) starts one ``attnlab validate``
per (kernel, dtype), bf16 and fp16, both strategies (default and
adversarial), in parallel subprocesses (compiling and autotuning the
library's Triton kernels is CPU-bound), each into ``DIR/<formulation>.<op>-<dtype>/``
(report.json, summary.md, curve/, log.txt), writes ``DIR/campaign.json``,
then renders ``DIR/campaign.md``. Everything is bounded by ``--budget``
seconds, shared fairly: the jobs run in waves of ``--jobs``, and every job
gets the same slot, budget / waves (the first campaign spent the budget on
the first jobs, and half never started); within it ``attnlab validate``
measures the curve first (``--curve-first``), then stops starting searches
``SLOT_MARGIN`` seconds before the slot ends, and is killed at the slot's end
(plus ``KILL_GRACE``); ``--strict`` is passed on to every ``attnlab validate``. The dtypes of one kernel are adjacent and the kernels
that compile most go first (the target's rule over function names: fla's
``chunk_*``). Head dims are fixed at 64 and heads at most 2 (fla autotunes
per K, V and H), T up to 1024; the curve runs T = 64..4096 at B=1, H=2,
K=V=64 beside attnlab's own kernels and the naive recurrences (the gallery
has the long curves: the naive same-dtype recurrences are Python loops, and
T = 16384 cost chunk_gla and chunk_kda their curve).

A job's status is its report.json's overall verdict where it wrote one
(``attnlab validate``'s three grades: *held* within the accuracy bound,
*imprecise* above it up to the correctness bound, i.e. the right function
less accurately, *failed* above that, erring or not run), else what its exit
code or the clock says: held (0, no report), failed (1), error (another
code), timed out (killed at its slot's end), not started (the budget spent).

Rendering (anywhere, from the fetched DIR) writes the Markdown report: the
jobs counted by status, a summary row per job (its verdict, the property
runs per strategy by grade, the worst imprecise figure against both bounds),
and per kernel the excess by length (the library beside attnlab), every
property's verdict, the imprecise ones with their worst figure and input,
every property that failed with its minimal counterexample, each classified
(``classify``: bug, rounding on an exactly representable output, accuracy
finding, does not apply), and for the bugs alone a standalone script
reproducing them.

Exit status: 0 when every job ran and none failed (imprecise ones pass,
unless ``--strict``: given to the run or the render, or recorded in
campaign.json by a run with it); 1 when a job failed a property, erred, was
killed or did not start, or under ``--strict`` was imprecise; 2 on a usage
error (unknown target or op, bad number, no CUDA GPU or the library missing
for a run, no results to render).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.commands import EXIT_FAILED, EXIT_HELD, EXIT_USAGE, usage_error
from attnlab.conventions import FLA_NUMERICS_ENV
from attnlab.metrics import FAILED, HELD, IMPRECISE, VERDICTS
from attnlab.registry import BOUNDS, REGISTRY
from attnlab.spec import Peer


@dataclass(frozen=True)
class Target:
    """A library with a campaign: what its kernels are called through and how its report reads.

    ``library`` is the ``Peer.library`` its kernels carry; ``convention`` is ``attnlab validate
    --convention``'s name for its calling convention; ``slow_prefixes`` are the function-name prefixes of
    the kernels that compile and autotune most (their jobs start first); ``env`` the environment variables
    that change its numerics (recorded); ``calling`` the report's paragraph on how its kernels are called.
    """

    library: str
    title: str
    distribution: str
    convention: str
    slow_prefixes: tuple[str, ...]
    env: tuple[str, ...]
    calling: str


TARGETS: dict[str, Target] = {
    "fla": Target(
        library="fla", title="flash-linear-attention", distribution="fla-core", convention="fla",
        slow_prefixes=("chunk_",), env=FLA_NUMERICS_ENV,
        calling="Each kernel is called in its own convention (the registry's peers: fla's keywords, log gates, "
                "`(o, final_state)` with `output_final_state`, fp32 states, RWKV-4's `log w` and `[B, 3, 1, C]` "
                "state, linear attention's feature map applied outside) through the adapter, so that attnlab's "
                "oracles and properties apply unchanged."),
}

DTYPES = ("bfloat16", "float16")
LENGTHS = "64,256,1024,4096"
CURVE_SHAPE = "1,2,64,64"
# Seconds kept at the end of a job's slot: a search started just before the --time-budget runs on into it, and
# the report is written after it.
SLOT_MARGIN = 25
# Seconds a job may run past its slot before it is killed (a killed job writes no report).
KILL_GRACE = 10
# A job with less time than this left is not started.
MIN_START = 30
REPORT_NAME = "campaign.md"
# A job's statuses, from best to worst: validate's verdicts (its report.json), then what stopped a job without one.
STATUSES = (*VERDICTS, "error", "timed out", "not started")


def known_targets() -> list[str]:
    """The libraries named by the registry's peers that have a campaign, in registry order."""
    libraries = dict.fromkeys(p.library for f in REGISTRY for p in f.peers)
    return [library for library in libraries if library in TARGETS]


@dataclass(frozen=True)
class Job:
    formulation: str
    peer: Peer
    dtype: str

    @property
    def op(self) -> str:
        return self.peer.attribute

    @property
    def folder(self) -> str:
        return f"{self.formulation}.{self.op}-{self.dtype}"


def kernels(target: Target, ops: list[str] | None = None) -> list[tuple[str, Peer]]:
    """(formulation, peer) of every registry peer of the target's library, in registry order (``ops``: only those)."""
    return [(f.name, p) for f in REGISTRY for p in f.peers
            if p.library == target.library and (ops is None or p.attribute in ops)]


def job_order(target: Target, chosen: list[tuple[str, Peer]], dtypes: list[str]) -> list[Job]:
    """Every (kernel, dtype): the slow-compiling kernels first, registry order otherwise, one kernel's dtypes adjacent."""
    def slow(item: tuple[str, Peer]) -> bool:
        return item[1].attribute.startswith(target.slow_prefixes)

    ordered = [k for k in chosen if slow(k)] + [k for k in chosen if not slow(k)]
    return [Job(name, peer, dtype) for name, peer in ordered for dtype in dtypes]


def slot_seconds(budget: float, jobs: int, count: int) -> float:
    """Each job's share of the budget: the jobs run in ceil(count / jobs) waves of ``jobs``."""
    waves = max(1, -(-count // max(1, jobs)))
    return (budget - KILL_GRACE) / waves


def job_command(target: Target, job: Job, out: Path, examples: int, time_budget: float, strict: bool = False) -> list[str]:
    return [sys.executable, "-m", "attnlab.cli", "validate", "--kernel", job.peer.function,
            "--convention", target.convention, "--formulation", job.formulation,
            "--device", "cuda", "--dtype", job.dtype, "--strategy", "both", "--examples", str(examples),
            "--dims", "64", "--max-T", "1024", "--max-H", "2", "--max-B", "2", "--minimize", "12",
            "--lengths", LENGTHS, "--curve-shape", CURVE_SHAPE, "--curve-first", "--time-budget", f"{time_budget:.0f}",
            "--out", str(out), "--no-progress", *(["--strict"] if strict else [])]


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def read_report(path: Path) -> dict[str, Any] | None:
    """A job's report.json, or None where there is none (or only part of one: the job was killed writing it)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def job_status(record: dict[str, Any], report: dict[str, Any] | None) -> str:
    """A job's status: its report's overall verdict (held, imprecise, failed) where it has a report, else the
    record's (from the exit code or the clock)."""
    if report is None:
        return record["status"]
    verdict = report.get("verdict")
    if verdict in VERDICTS:
        return verdict
    return HELD if report.get("held") else FAILED  # a report.json from before the three verdicts


def job_passed(status: str, strict: bool) -> bool:
    """Whether a job's status lets the campaign exit 0: held, or imprecise unless ``strict``."""
    return status == HELD or (status == IMPRECISE and not strict)


def status_counts(statuses: list[str]) -> str:
    """"3 jobs: 1 held, 1 imprecise, 1 timed out", in STATUSES' order (any other status last)."""
    order = list(dict.fromkeys([*STATUSES, *statuses]))
    return f"{len(statuses)} jobs: " + ", ".join(f"{statuses.count(s)} {s}" for s in order if s in statuses)


def run_campaign(target: Target, out: Path, budget: float, jobs: int, examples: int, work: list[Job],
                 command: str = "", strict: bool = False) -> dict[str, Any]:
    """Run every job (see the module's docstring) and write ``out/campaign.json``; returns what it wrote."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + budget
    slot = slot_seconds(budget, jobs, len(work))
    records: dict[str, dict[str, Any]] = {}
    print(f"campaign {target.library}: {len(work)} jobs, {jobs} at a time, {slot:.0f} s each (budget {budget:.0f} s)",
          flush=True)

    def one(job: Job) -> None:
        folder = out / job.folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.json").unlink(missing_ok=True)  # an earlier run's: not this job's verdict
        left = min(slot + KILL_GRACE, deadline + KILL_GRACE - time.time())
        record: dict[str, Any] = {"formulation": job.formulation, "op": job.op, "function": job.peer.function,
                                  "dtype": job.dtype, "folder": job.folder, "slot_s": round(slot)}
        if left < MIN_START:
            record.update(status="not started", detail=f"campaign budget of {budget:.0f} s spent")
            records[job.folder] = record
            return
        argv = job_command(target, job, folder, examples, max(10.0, min(slot, left) - SLOT_MARGIN), strict)
        record["command"] = " ".join(shlex.quote(c) for c in argv[1:]).replace("-m attnlab.cli", "attnlab", 1)
        started = time.time()
        with open(folder / "log.txt", "w") as log:
            try:
                rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=left, check=False).returncode
                record.update(status={EXIT_HELD: "held", EXIT_FAILED: "failed"}.get(rc, "error"), rc=rc)
            except subprocess.TimeoutExpired:
                record.update(status="timed out", rc=None, detail=f"killed after {left:.0f} s (its slot)")
        record["status"] = job_status(record, read_report(folder / "report.json"))
        record["seconds"] = round(time.time() - started, 1)
        records[job.folder] = record
        print(f"{job.folder}: {record['status']} ({record['seconds']} s)", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, work))
    summary = {"what": f"attnlab validate on {target.title}'s kernels", "target": target.library,
               "version": _version(target.distribution), "command": command, "budget_s": budget,
               "slot_s": round(slot), "jobs": jobs, "examples": examples, "strict": strict, "lengths": LENGTHS, "curve_shape": CURVE_SHAPE,
               "env": {k: os.environ.get(k) for k in target.env},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start)),
               "records": [records[job.folder] for job in work if job.folder in records]}
    (out / "campaign.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"campaign {target.library}: " + status_counts([r["status"] for r in records.values()]))
    return summary


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
    if v["status"] == "refused":
        return "limitation", "the kernel refuses its backward: " + (detail.splitlines()[0][:200] if detail else "it raised")
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


def load_results(results: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(campaign.json, its records, folder -> report.json) of a results folder.

    Without a campaign.json (a run cut off before writing it), every subfolder holding a report.json is a
    record, described from its report. Every record's status is :func:`job_status`'s (a campaign.json from
    before the three verdicts recorded "held" for an imprecise job).
    """
    campaign = json.loads((results / "campaign.json").read_text()) if (results / "campaign.json").exists() else {"records": []}
    records = campaign["records"]
    if not records:
        for path in sorted(results.glob("*/report.json")):
            rep = json.loads(path.read_text())
            records.append({"folder": path.parent.name, "formulation": rep["formulation"],
                            "op": rep["kernel"].rpartition(":")[2], "dtype": ",".join(rep.get("dtypes", [])) or "?",
                            "status": "?"})
    reports: dict[str, dict[str, Any]] = {}
    for r in records:
        report = read_report(results / r["folder"] / "report.json")
        if report is not None:
            reports[r["folder"]] = report
            r.setdefault("formulation", report["formulation"])
        r["status"] = job_status(r, report)
    return campaign, records, reports


def _imprecise_text(verdicts: list[dict[str, Any]]) -> str:
    """"2 imprecise (worst 3.2; held <= 1.5, failed > 8)": the imprecise runs and the worst figure against both
    bounds, as far as the report has them."""
    imprecise = [v for v in verdicts if v["status"] == IMPRECISE]
    figures = [v for v in imprecise if v.get("figure") is not None and v.get("bound")]
    text = f"{len(imprecise)} imprecise"
    if not figures:
        return text
    worst = max(figures, key=lambda v: v["figure"] / v["bound"])
    bounds = f"held <= {worst['bound']:.3g}" + (f", failed > {worst['correctness']:.3g}" if worst.get("correctness") else "")
    return f"{text} (worst {worst['figure']:.3g}; {bounds})"


def _runs_cell(verdicts: list[dict[str, Any]]) -> str:
    """A strategy's property runs in the summary: "held" when all held, else counted by grade."""
    if not verdicts:
        return "-"
    if all(v["status"] == HELD for v in verdicts):
        return HELD
    count = lambda *statuses: sum(v["status"] in statuses for v in verdicts)  # noqa: E731
    parts = [f"{count(HELD)} held" if count(HELD) else "", _imprecise_text(verdicts) if count(IMPRECISE) else "",
             f"{count(FAILED, 'error')} failed" if count(FAILED, "error") else "",
             f"{count('refused')} refused (backward)" if count("refused") else "",
             f"{count('skipped', 'not run')} not run" if count("skipped", "not run") else ""]
    return ", ".join(p for p in parts if p)


def _bounds_words(reports: list[dict[str, Any]], dtypes: list[str]) -> str:
    """The bounds the jobs were graded by (their reports' "bounds"; the registry's for reports without)."""
    table = {d: b for rep in reports for d, b in (rep.get("bounds") or {}).items()}
    for d in dtypes:
        if d not in table and d in BOUNDS:
            table[d] = {"accuracy": BOUNDS[d].accuracy, "correctness": BOUNDS[d].correctness}
    return "; ".join(f"{d} held <= {b['accuracy']:g}, failed > {b['correctness']:g}" for d, b in table.items())


def render(target: Target, results: Path, destination: Path, strict: bool = False) -> int:
    """Write the Markdown report of a results folder to ``destination``; returns the campaign's exit status
    (``strict``, or a campaign.json recording a run with --strict: an imprecise job fails the campaign)."""
    from attnlab.commands.report import summary_table

    campaign, records, reports = load_results(results)
    strict = strict or bool(campaign.get("strict"))
    first = next(iter(reports.values()), None)
    version = campaign.get("version") or (first or {}).get("versions", {}).get(target.distribution) or "(version unknown)"
    lines = [f"# {target.title} {version} under `attnlab validate`", ""]
    if first:
        env = ", ".join(f"{k}={'unset' if v is None else v}" for k, v in first["env"].items())
        lines += [f"- Device: {first['device']['name']}",
                  "- Versions: " + ", ".join(f"{k} {v}" for k, v in first["versions"].items()),
                  f"- Environment (changes {target.library}'s numerics): {env}",
                  f"- Search: {first['examples']} examples per (property, strategy, dtype), derandomized, sizes "
                  f"{first['sizes']}, head dims 64; failures minimized greedily (at most 12 checks).",
                  f"- Curve: T = {campaign.get('lengths', LENGTHS)}, shape B,H,K,V = {campaign.get('curve_shape', CURVE_SHAPE)}, "
                  "the registry's default inputs (seed 0), against the float64 oracle.",
                  f"- Campaign: `{campaign.get('command') or f'attnlab campaign {target.library}'}` (budget "
                  f"{campaign.get('budget_s', '?')} s, {campaign.get('jobs', '?')} parallel jobs), rendered by "
                  f"`attnlab campaign --render DIR`; started {campaign.get('started', '?')}.", ""]
    lines += [
        target.calling + " *default*: the registry's default input distributions; *adversarial*: gates "
        "down to -20 per step, beta at 0 and 2, nearly parallel keys, logits and keys past the dtype's exp "
        "overflow. Verdicts: *held* within the accuracy bound, *imprecise* above it up to the correctness bound "
        "(the right function, less accurately), *failed* above that; bounds (excess = rel_err / floor): "
        f"{_bounds_words(list(reports.values()), [r['dtype'] for r in records])}; final states 2^-7 (bf16), "
        "2^-10 (fp16) relative; causality bitwise (attnlab.properties.checks). A job's verdict is its worst "
        "(property runs and curve points)" + ("; under --strict an imprecise job fails the campaign." if strict else "."),
        "", "## Summary", "", status_counts([r["status"] for r in records]) + ".", ""]
    body = []
    for r in records:
        rep = reports.get(r["folder"])
        if rep is None:
            body.append([r.get("formulation", "?"), f"`{r['op']}`", r["dtype"], r["status"], "", "", "", "", r.get("detail", "")])
            continue
        verdicts = rep["verdicts"]
        rows = rep["curve"].get("rows", [])
        failed = sorted({v["property"] for v in verdicts if v["status"] in (FAILED, "refused")})
        imprecise = sorted({v["property"] for v in verdicts if v["status"] == IMPRECISE})
        own = sorted({x["impl"] for x in rows if x["impl"].startswith("attnlab:")})
        properties = "; ".join(part for part in (", ".join(failed), f"imprecise: {', '.join(imprecise)}" if imprecise else "",
                                                 f"job {r['detail']}" if r.get("detail") else "") if part)
        body.append([rep["formulation"], f"`{r['op']}`", r["dtype"], r["status"],
                     *(_runs_cell([v for v in verdicts if v["strategy"] == s]) for s in ("default", "adversarial")),
                     _excess_text(rows, rep["kernel"]), ", ".join(f"{i.split(':')[1]} {_excess_text(rows, i)}" for i in own),
                     properties])
    lines += _md_table(["formulation", f"{target.library} kernel", "dtype", "verdict", "default", "adversarial",
                        f"worst curve excess ({target.library})", "worst curve excess (attnlab)",
                        "failed / imprecise properties"], body)
    lines += ["", "Worst curve excess: the largest excess over T of the error-vs-length curve below.", ""]
    # One section per kernel: the registry's order, then any the registry no longer names.
    sections = list(dict.fromkeys([(name, p.attribute) for name, p in kernels(target)]
                                  + [(r["formulation"], r["op"]) for r in records]))
    bugs: list[tuple[str, dict[str, Any], str, str]] = []
    for name, op in sections:
        mine = [r for r in records if r["op"] == op and r["formulation"] == name]
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
                [[v["strategy"], v["dtype"], v["property"], {"held": "held", "imprecise": "imprecise", "failed": "**FAILED**", "refused": "**REFUSED**",
                  "error": "ERROR", "skipped": "not run"}[v["status"]], str(v["examples"]), v["figure_text"],
                  f"`{v['case']}`" if v["case"] else v["detail"][:120]]
                 for _, v in verdicts]), ""]
        imprecise = [v for _, v in verdicts if v["status"] == IMPRECISE]
        if imprecise:
            lines += ["### Imprecise", "", "Above the accuracy bound, within the correctness bound: the right function, "
                      "less accurately than the bound allows" + (" (fails the campaign under --strict)." if strict else "."), ""]
            lines += [f"- **{v['property']}** ({v['strategy']}, {v['dtype']}): {v['figure_text']}"
                      + (f"; worst input `{v['case']}`" if v.get("case") else "") + "." for v in imprecise]
            lines.append("")
        failures = [(rep, v) for rep, v in verdicts if v["status"] in ("failed", "refused", "error")]
        if failures:
            lines += ["### Failures", ""]
            for rep, v in failures:
                kind, reason = classify(v, target.library)
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
                  f"Each script runs on a CUDA machine with {target.distribution} {version} and attnlab installed; it "
                  f"calls {target.library}'s kernel through its declared convention (the registry's peer) on the "
                  "minimal counterexample and prints the check's report.", ""]
        for title, v, script, why in bugs:
            lines += [f"### {title}", "", f"{why}.", "", "```python", script.rstrip(), "```", ""]
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text("\n".join(line for line in lines if line is not None).rstrip() + "\n")
    every = bool(records) and all(job_passed(r["status"], strict) for r in records)
    return EXIT_HELD if every else EXIT_FAILED


# ----------------------------------------------------------------------------- command line


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``attnlab campaign`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "campaign", help="attnlab validate on every kernel of a library (GPU), rendered as one Markdown report",
        description="Run attnlab validate on every kernel the registry's peers name for TARGET (a GPU with the "
                    "library installed), then render DIR/campaign.md; or, with --render DIR, only re-render "
                    "fetched results. A job's status is its report's verdict (held, imprecise, failed) where it wrote "
                    "one, else its exit code's or the clock's (error, timed out, not started).",
        epilog="Exit status: 0 every job ran and none failed (imprecise ones pass unless --strict); 1 a job failed, "
               "erred, was killed or did not start, or was imprecise under --strict; 2 usage error.")
    parser.add_argument("target", nargs="?", default=None, metavar="TARGET",
                        help=f"the library: {', '.join(known_targets())} (with --render: default the results' own)")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for the whole campaign (default 400)")
    parser.add_argument("--jobs", type=int, default=10, help="validate processes at a time (default 10)")
    parser.add_argument("--examples", type=int, default=6, help="examples per property, strategy and dtype (default 6)")
    parser.add_argument("--ops", default=None, help="comma-separated function names (default: every kernel of the target)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated (default {','.join(DTYPES)})")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default out/campaign-TARGET)")
    parser.add_argument("--render", type=Path, default=None, metavar="DIR",
                        help="only render the results in DIR (a run's --out), on any machine; the run's options but --strict are ignored")
    parser.add_argument("--report", type=Path, default=None, metavar="PATH",
                        help=f"where the Markdown goes (default DIR/{REPORT_NAME})")
    parser.add_argument("--strict", action="store_true",
                        help="an imprecise job (above the accuracy bound, within the correctness bound) fails the "
                             "campaign (exit 1); passed on to every attnlab validate (with --render: as does a "
                             "campaign.json recording a run with --strict)")
    parser.set_defaults(func=command)
    return parser


def _usage(message: str) -> int:
    return usage_error("campaign", message)


def _target(name: str | None) -> Target | str:
    """The Target named ``name``, or the usage error's message."""
    known = known_targets()
    if name is None:
        return f"name a target: one of {', '.join(known)}"
    if name not in known:
        return f"unknown target {name!r}; known: {', '.join(known)}"
    return TARGETS[name]


def command(args: argparse.Namespace) -> int:
    if args.render is not None:
        return _render_command(args)
    target = _target(args.target)
    if isinstance(target, str):
        return _usage(target)
    if args.budget <= 0 or args.jobs < 1 or args.examples < 1:
        return _usage("--budget must be positive, --jobs and --examples at least 1")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in EPS for d in dtypes):
        return _usage(f"--dtypes must be some of {', '.join(EPS)}; got {args.dtypes!r}")
    available = dict.fromkeys(p.attribute for _, p in kernels(target))
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    if ops is not None and (not ops or any(o not in available for o in ops)):
        return _usage(f"--ops: unknown {', '.join(o for o in ops if o not in available) or '(none given)'}; "
                      f"{target.library}'s kernels: {', '.join(available)}")
    import torch

    if not torch.cuda.is_available():
        return _usage("a campaign runs on a CUDA GPU (none is visible here); --render DIR renders fetched results anywhere")
    module = kernels(target)[0][1].function.partition(":")[0]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return _usage(f"{target.library} is not importable here (pip install {target.distribution})")
    out = args.out or Path("out") / f"campaign-{target.library}"
    work = job_order(target, kernels(target, ops), dtypes)
    invocation = " ".join(["attnlab campaign", target.library, *(f"--{k} {getattr(args, k)}" for k in ("budget", "jobs", "examples")),
                           *([f"--ops {args.ops}"] if args.ops else []), *(["--strict"] if args.strict else [])])
    run_campaign(target, out, args.budget, args.jobs, args.examples, work, command=invocation, strict=args.strict)
    return _render_and_say(target, out, args.report or out / REPORT_NAME, args.strict)


def _render_and_say(target: Target, results: Path, destination: Path, strict: bool) -> int:
    status = render(target, results, destination, strict)
    print(f"wrote {destination}; " + ("every job ran and none failed" if status == EXIT_HELD else
                                      "a job failed, erred or did not run, or was imprecise under --strict"))
    return status


def _render_command(args: argparse.Namespace) -> int:
    results: Path = args.render
    if not (results / "campaign.json").exists() and not any(results.glob("*/report.json")):
        return _usage(f"--render {results}: no campaign.json and no */report.json there")
    name = args.target
    if name is None and (results / "campaign.json").exists():
        name = json.loads((results / "campaign.json").read_text()).get("target")
    if name is None and len(known_targets()) == 1:  # results from before campaign.json named its target
        name = known_targets()[0]
    target = _target(name)
    if isinstance(target, str):
        return _usage(target)
    return _render_and_say(target, results, args.report or results / REPORT_NAME, args.strict)
