"""The Markdown report of an ``attnlab campaign`` results folder (attnlab.commands.campaign).

It reads ``DIR/campaign.json`` (the plan and every item's result), or, without one, the plan and the
``results/*.jsonl`` lines a run cut short left behind. A *cell* is one (kernel, dtype): its status is the worst
of its items (attnlab validate's grades: held, imprecise, failed; refused and error count as failed), or
"incomplete" when some items have no result and none failed, "not run" when none has, "error" when the kernel
could not be called at all.

The report: how the campaign ran (device, versions, environment, search, curve, workers, wall time), the cells
counted by status, a summary row per cell (its status, the property runs per strategy by grade, the worst
curve excess beside attnlab's own kernels, the failed and imprecise properties), then per kernel its
convention, error-vs-length table, every property's verdict, the imprecise ones with their worst figure and
input, every failure with its minimal counterexample, classified (:func:`classify`: bug, rounding on an exactly
representable output, accuracy finding, does not apply, attnlab's check failed), and for the bugs alone a
standalone script reproducing them.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import torch

from attnlab.commands import EXIT_FAILED, EXIT_HELD, usage_error
from attnlab.metrics import FAILED, HELD, IMPRECISE, UNIT_ROUNDOFF, VERDICTS, worst_verdict
from attnlab.registry import BOUNDS

PLAN_NAME = "plan.json"
RESULTS_DIR = "results"
SUMMARY_NAME = "campaign.json"
REPORT_NAME = "campaign.md"
CURVE = "curve"  # the property name of a cell's error-vs-length item
NOT_APPLICABLE = "not applicable"  # a backward item of a kernel that is not differentiable
# A cell's statuses, from best to worst.
STATUSES = (*VERDICTS, "incomplete", "not run", "error")
# Properties that are identities (any correct implementation keeps them, up to rounding), not accuracy bounds.
IDENTITIES = {"causality", "split_and_resume", "chunk_size_invariance", "reduces_to_special_case", "convexity",
              "shift_invariance"}
# An excess at least this many times the bound is a bug wherever it shows; below ACCURACY_RATIO on the default
# inputs it is an accuracy finding ("less accurate than the bound").
BUG_RATIO = 10.0
ACCURACY_RATIO = 4.0

# A tensor of at most FEW_ENTRIES entries has a rounding floor that is luck: the relative error of rounding random
# values once is about TYPICAL_ROUNDING eps (measured: 1.6e-3 in bf16 on large tensors), a single value's anywhere in [0, eps / 2].
FEW_ENTRIES = 16
TYPICAL_ROUNDING = 0.21
VERDICT_CELLS = {"held": "held", "imprecise": "imprecise", "failed": "**FAILED**", "refused": "**REFUSED**",
                 "error": "ERROR", "not run": "not run"}
KIND_WORDS = {"bug": "Bug", "representable": "Rounding on an exactly representable output",
              "contract": "Contract (what the kernel returns)",
              "accuracy": "Accuracy finding", "limitation": "Does not apply", "error": "attnlab's check failed"}


def _eps(dtype: str) -> float:
    """Machine epsilon (the spacing at 1, twice attnlab.metrics' unit roundoff) of a dtype named in a report."""
    return 2 * UNIT_ROUNDOFF.get(getattr(torch, dtype, None), UNIT_ROUNDOFF[torch.bfloat16])


def _number(detail: str, key: str) -> float | None:
    match = re.search(rf"{key}\s+([-+0-9.eE]+|inf|nan)", detail or "")
    try:
        return float(match.group(1)) if match else None
    except ValueError:
        return None


def _far_past_rounding(rel: float | None, bound: float | None, eps: float) -> bool:
    """A relative error that is a bug whatever the output's own rounding floor: BUG_RATIO times the bound counted in
    typical roundings (TYPICAL_ROUNDING eps). Where that floor is 0 (an exactly representable output) or luck (a few
    entries), the excess says nothing, and a grossly wrong kernel's minimal counterexample (a stale gate at T = 2,
    K = V = 1) would otherwise read as rounding."""
    return rel is not None and bound is not None and rel >= BUG_RATIO * bound * TYPICAL_ROUNDING * eps


def classify(v: dict[str, Any], who: str = "the kernel") -> tuple[str, str]:
    """(kind, why) of a failed or erring verdict; kind is "bug", "representable", "contract", "accuracy", "limitation"
    or "error".

    bug: the kernel raised, returned NaN/inf where the oracle is finite, broke an identity (causality; a
    split-and-resumed final state, convexity or another identity by ACCURACY_RATIO times its rounding allowance or
    more) or missed the bound by 10x or more (in typical roundings where the output's own floor is 0 or a few entries'
    luck: _far_past_rounding). representable: the exact output is representable in the dtype
    (floor_round 0), so any rounding at all shows as an unbounded excess. accuracy: past the bound by less (on the
    default inputs below 4x: "less accurate than the bound"; a gradient of at most FEW_ENTRIES entries whose realized
    rounding floor is far below the typical one). contract: the kernel returns another dtype or shape than its
    convention says. limitation: a property that cannot apply to this
    kernel (its state omits a part the run needs; a backward it refuses). error: attnlab's check itself failed.
    """
    detail, measure = v.get("detail") or "", v.get("measure") or ""
    if v["status"] == "error":
        return "error", "the check could not run (attnlab's side): " + detail.splitlines()[0][:200] if detail else "the check could not run"
    if v["status"] == "refused":
        what = "declines every input drawn" if "declined" in measure else "refuses its backward"
        return "limitation", f"the kernel {what}: " + (detail.splitlines()[0][:200] if detail else "it raised")
    if "raised" in measure:
        return "bug", "the kernel raised on a valid input"
    if measure == "state parts carried":
        return "limitation", detail.split("; split at")[0]
    if "the process running this item died" in detail:
        return "bug", "the kernel crashed the process running it"
    if "expected the input dtype" in detail or "expected shape" in detail:
        return "contract", detail.split(";")[0]
    figure, bound = v.get("figure"), v.get("bound")
    floor_round = _number(detail, "floor_round")
    nonfinite = _number(detail, "non-finite entries")
    if figure is None and not (floor_round == 0.0 and nonfinite == 0.0):
        return "bug", "non-finite output where the float64 oracle is finite"
    ratio = figure / bound if bound and figure is not None else math.inf
    base = v["property"].partition("[")[0]
    if base == "causality" or (base == "backward_causality" and "not zero" in measure):
        return "bug", "causality is an identity every correct implementation keeps (a result moved when only later inputs changed)"
    if base == "split_and_resume" and "state" in measure:
        if ratio >= ACCURACY_RATIO:
            return "bug", f"the split-and-resumed final state differs from the oracle's by {ratio:.3g}x the rounding allowance ({figure:.3g} > {bound:.3g} relative)"
        return "accuracy", f"the split-and-resumed final state is off by {ratio:.3g}x the rounding allowance ({figure:.3g} > {bound:.3g} relative)"
    if base in IDENTITIES and "excess" not in measure:
        if ratio >= ACCURACY_RATIO:
            return "bug", f"{base} is an identity, broken by {ratio:.3g}x its rounding allowance"
        return "accuracy", f"{base} is kept only up to {ratio:.3g}x its rounding allowance (a few ulps): less accurate than the bound"
    rel, eps = _number(detail, "rel_err"), _eps(v["dtype"])
    if floor_round == 0.0 and "excess" in measure and rel == math.inf:
        return "representable", ("the exact value is zero here (its floors are 0), so any rounding at all, fp32 "
                                 "accumulation noise included, reads as an infinite excess")
    if floor_round == 0.0 and "excess" in measure:
        ulps = re.search(r"off by up to ([0-9.eE+-]+) ulps", detail)
        if ulps:
            off = f"off by up to {float(ulps.group(1)):.3g} ulps"
        else:
            max_err = _number(detail, "max_err")
            off = (f"off by {rel / eps:.2g} ulps norm-wise (rel_err {rel:.3g}, max_err {max_err:.3g})"
                   if rel is not None and max_err is not None else "off by a few ulps")
        if _far_past_rounding(rel, bound, eps):
            return "bug", (f"the exact output is representable in {v['dtype']} and {who} is {off}, past "
                           f"{BUG_RATIO:g}x the bound in typical roundings")
        return "representable", f"the exact output is representable in {v['dtype']}, so any rounding shows; {who} is {off}"
    entries = re.search(r"non-finite entries \d+ of (\d+)", detail)
    if entries and int(entries.group(1)) <= FEW_ENTRIES and floor_round is not None and rel is not None \
            and floor_round < TYPICAL_ROUNDING * eps / 4 and not _far_past_rounding(rel, bound, eps):
        return "accuracy", (f"{entries.group(1)} entries: rounding them once happened to cost only {floor_round:.2g} "
                            f"relative (typically about {TYPICAL_ROUNDING * eps:.2g}), so the excess overstates; the "
                            f"error itself is {rel / eps:.2g} ulps")
    if ratio >= BUG_RATIO:
        return "bug", f"{ratio:.3g}x the bound ({figure:.3g} > {bound:.3g})"
    if v["strategy"] == "default":
        if ratio < ACCURACY_RATIO:
            return "accuracy", f"less accurate than the bound on the default inputs ({figure:.3g} vs {bound:.3g}, {ratio:.2g}x)"
        return "accuracy", f"well past the bound on the default inputs ({ratio:.3g}x; below the {BUG_RATIO:g}x taken for a bug)"
    return "accuracy", f"past the bound on adversarial inputs ({ratio:.3g}x)"


# ----------------------------------------------------------------------------- results


def node_id(key: str) -> str:
    """The item's pytest id: its key, with brackets (a gradient's) made safe for node ids."""
    return key.replace("[", ".").replace("]", "")


def read_results(out: Path) -> dict[str, dict[str, Any]]:
    """Every stored item result in ``out/results/*.jsonl``, by key: the one that finished last (a resumed run
    appends to files of other workers' names than the run it resumes, so neither file order nor line order says
    which is newer; records of one second keep their line order); a line cut off by a kill is ignored."""
    records: list[dict[str, Any]] = []
    for path in sorted((out / RESULTS_DIR).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    found: dict[str, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: r.get("finished", "")):
        found[record["key"]] = record
    return found


def junit_outcomes(path: Path) -> dict[str, str]:
    """pytest id -> the message of every item pytest recorded as failed or erred (a worker that crashed under it),
    from the run's junit XML; empty when there is none."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    outcomes = {}
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                name = case.get("name", "")
                outcomes[name.partition("[")[2][:-1]] = (node.get("message") or node.text or tag).strip().splitlines()[0][:300]
    return outcomes


def summarize(out: Path, plan: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``out/campaign.json``: the plan, every item's merged result (or why it has none) and the runs' wall times."""
    results = read_results(out)
    crashed = junit_outcomes(out / "junit.xml")
    items = []
    for item in plan["items"]:
        record = results.get(item["key"])
        if record is None:
            why = crashed.get(node_id(item["key"]))
            record = {**item, "status": "not run",
                      "detail": f"no result: {why}" if why else "not reached: the campaign stopped before this item"}
        items.append(record)
    summary = {"what": "attnlab campaign: the property suite on every kernel of a library",
               **{k: v for k, v in plan.items() if k != "items"}, "items": items, "runs": runs}
    (out / SUMMARY_NAME).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary



# ----------------------------------------------------------------------------- cells


def _verdicts_of(item: dict[str, Any]) -> list[dict[str, Any]]:
    """An item's verdict rows (attnlab validate's fields: one, or one per gradient of a backward check); an item
    without them (not run, harness error) gets one row saying why."""
    if item.get("verdicts"):
        return item["verdicts"]
    return [{"strategy": item["strategy"], "dtype": item["dtype"], "property": item["property"],
             "status": item["status"], "examples": 0, "figure_text": "", "case": "", "found": "",
             "detail": item.get("detail", ""), "measure": "", "figure": None, "bound": None}]


def cells(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per (kernel, dtype), in the plan's kernel order: status, verdict rows, curve rows, repro scripts."""
    by_cell: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for item in summary["items"]:
        by_cell.setdefault((item["kernel"], item["dtype"]), []).append(item)
    out = []
    for kernel in summary["kernels"]:
        for dtype in summary["dtypes"]:
            cell: dict[str, Any] = {"kernel": kernel, "dtype": dtype, "id": kernel["id"], "op": kernel["op"],
                                    "formulation": kernel["formulation"], "verdicts": [], "rows": [], "repro": {},
                                    "detail": "", "seconds": 0.0}
            if "error" in kernel:
                cell.update(status="error", detail=f"cannot be called: {kernel['error']}")
                out.append(cell)
                continue
            items = by_cell.get((kernel["id"], dtype), [])
            for item in items:
                cell["seconds"] += item.get("seconds") or 0.0
                if item["property"] == CURVE:
                    cell["rows"] = item.get("rows", [])
                    if item["status"] in ("error", "not run"):
                        cell["curve_note"] = f"curve {item['status']}: {item.get('detail', '')}"
                    continue
                if item["status"] == NOT_APPLICABLE:
                    continue
                cell["verdicts"] += _verdicts_of(item)
                for name, script in (item.get("repro") or {}).items():
                    cell["repro"][f"{item['strategy']}/{dtype}/{name}"] = script
            cell["status"] = _cell_status([i["status"] for i in items])
            out.append(cell)
    return out


def _cell_status(statuses: list[str]) -> str:
    statuses = [s for s in statuses if s != NOT_APPLICABLE]
    graded = [FAILED if s in ("failed", "refused", "error") else s for s in statuses if s != "not run"]
    if FAILED in graded:
        return FAILED
    if not graded:
        return "not run"
    if len(graded) < len(statuses):
        return "incomplete"
    return worst_verdict(graded)


def cell_passed(status: str, strict: bool) -> bool:
    """Whether a cell lets the campaign exit 0: held, or imprecise unless ``strict``."""
    return status == HELD or (status == IMPRECISE and not strict)


def status_counts(statuses: list[str]) -> str:
    """"3 cells: 1 held, 1 imprecise, 1 not run", in STATUSES' order (any other status last)."""
    order = list(dict.fromkeys([*STATUSES, *statuses]))
    return f"{len(statuses)} cells: " + ", ".join(f"{statuses.count(s)} {s}" for s in order if s in statuses)


# ----------------------------------------------------------------------------- rendering


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(esc(c) for c in r) + " |" for r in rows)]


def _excess_text(rows: list[dict[str, Any]], impl: str) -> str:
    values = [r["excess"] for r in rows if r["impl"] == impl and r.get("excess") is not None]
    broken = [r for r in rows if r["impl"] == impl and (r.get("error") or r.get("excess") is None)]
    text = f"{max(values):.3g}" if values else "-"
    return text + (f" ({len(broken)} point(s) failed)" if broken else "")


def _imprecise_text(verdicts: list[dict[str, Any]]) -> str:
    """"2 imprecise (worst 3.2; held <= 1.5, failed > 8)": the imprecise runs and the worst figure against both bounds."""
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
             f"{count('not run')} not run" if count("not run") else ""]
    return ", ".join(p for p in parts if p)


def _bounds_words(dtypes: list[str]) -> str:
    return "; ".join(f"{d} held <= {BOUNDS[d].accuracy:g}, failed > {BOUNDS[d].correctness:g}" for d in dtypes if d in BOUNDS)


def _header(summary: dict[str, Any], strict: bool) -> list[str]:
    runs = summary.get("runs", [])
    env = ", ".join(f"{k}={'unset' if v is None else v}" for k, v in summary.get("env", {}).items()) or "none recorded"
    version = summary.get("versions", {}).get(summary.get("distribution") or "", "")
    walls = "; ".join(f"{r['items']} items in {r.get('seconds', 0):.0f} s on {r.get('workers', '?')}"
                      + (" (stopped at the budget)" if r.get("stopped") else "") for r in runs if r.get("items")) or "no run"
    return [
        f"# {summary['title']} {version} under `attnlab campaign`".replace("  ", " "), "",
        f"- Device: {summary['device']['name']}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in summary.get("versions", {}).items()),
        f"- Environment (changes the numerics): {env}",
        f"- Search: per item (kernel, dtype, strategy, property) at most {summary['examples']} examples within "
        f"{summary['item_budget_s']:g} s, derandomized, sizes {summary['sizes']}"
        + (f", head dims {', '.join(map(str, summary['dims']))}" if summary.get("dims") else "")
        + f"; failures minimized greedily (at most {summary['minimize']} checks); passes {', '.join(summary['passes'])}.",
        f"- Curve: T = {', '.join(map(str, summary['lengths'])) or 'none'}, shape {summary['curve_shape']}, the "
        "registry's default inputs (seed 0), against the float64 oracle, beside attnlab's own kernels.",
        f"- Campaign: `{summary.get('command') or 'attnlab campaign'}`, budget {summary['budget_s']:g} s, on pytest-xdist; "
        f"started {summary.get('started', '?')}; runs: {walls}.", "",
        summary.get("calling", "") + " *default*: the registry's default input distributions; *adversarial*: gates "
        "down to -20 per step, beta at 0 and 2, nearly parallel keys, logits and keys past the dtype's exp overflow. "
        "Verdicts: *held* within the accuracy bound, *imprecise* above it up to the correctness bound (the right "
        "function, less accurately), *failed* above that; bounds (excess = rel_err / floor): "
        f"{_bounds_words(summary['dtypes'])}; final states 2^-7 (bf16), 2^-10 (fp16) relative; causality bitwise "
        "(attnlab.properties.checks). A cell (kernel, dtype) takes its worst item"
        + ("; under --strict an imprecise cell fails the campaign." if strict else "."), ""]


def render(summary: dict[str, Any], destination: Path, strict: bool = False, preface: str = "") -> int:
    """Write the Markdown report of a campaign summary (campaign.json's content) to ``destination``; returns the
    campaign's exit status (``strict``, or a summary of a run with --strict: an imprecise cell fails it).
    ``preface``: Markdown placed after the header (what whoever ran the campaign found, in their words)."""
    from attnlab.commands.report import summary_table

    strict = strict or bool(summary.get("strict"))
    who = summary["title"]
    table = cells(summary)
    lines = _header(summary, strict)
    if preface.strip():
        lines += [preface.strip(), ""]
    lines += ["## Summary", "", status_counts([c["status"] for c in table]) + ".", ""]
    body = []
    for c in table:
        failed = sorted({v["property"] for v in c["verdicts"] if v["status"] in (FAILED, "refused", "error")})
        imprecise = sorted({v["property"] for v in c["verdicts"] if v["status"] == IMPRECISE})
        own = sorted({x["impl"] for x in c["rows"] if x["impl"].startswith("attnlab:")})
        notes = "; ".join(p for p in (", ".join(failed), f"imprecise: {', '.join(imprecise)}" if imprecise else "",
                                      c["detail"][:200]) if p)
        body.append([c["formulation"], f"`{c['op']}`", c["dtype"], c["status"],
                     *(_runs_cell([v for v in c["verdicts"] if v["strategy"] == s]) for s in ("default", "adversarial")),
                     _excess_text(c["rows"], c["kernel"]["function"]) if c["rows"] else "-",
                     ", ".join(f"{i.split(':')[1]} {_excess_text(c['rows'], i)}" for i in own), notes])
    lines += _md_table(["formulation", f"{who} kernel", "dtype", "verdict", "default", "adversarial",
                        f"worst curve excess ({who})", "worst curve excess (attnlab)", "failed / imprecise properties"],
                       body)
    lines += ["", "Worst curve excess: the largest excess over T of the error-vs-length curve below.", ""]
    bugs: list[tuple[str, str, str]] = []
    for kernel in summary["kernels"]:
        mine = [c for c in table if c["id"] == kernel["id"]]
        lines += [f"## {kernel['formulation']}: `{kernel['op']}`", "", f"`{kernel['function']}`" + (
            f" ({kernel['label']})" if kernel.get("label") else ""), ""]
        if "error" in kernel:
            lines += [f"Could not be called: {kernel['error'][:600]}", ""]
            continue
        convention = kernel.get("resolved") or {}
        lines += [f"Convention: {convention.get('describe', kernel['convention'])}", ""]
        if any(i["status"] == NOT_APPLICABLE for i in summary["items"] if i["kernel"] == kernel["id"]):
            lines += ["Not differentiable (called on inputs that require grad, its output does not): its backward "
                      "items do not apply.", ""]
        if convention.get("derived"):
            lines += [f"Note: this kernel computes {', '.join(convention['derived'])} itself (in fp32), while the "
                      "oracle sees the registry's value rounded to the dtype: part of a small excess can be that "
                      "rounding, not the kernel.", ""]
        rows = [x for c in mine for x in c["rows"]]
        if rows:
            lines += ["### Excess by length", "", *summary_table(rows), ""]
        lines += [f"- {c['dtype']}: {c['curve_note']}" for c in mine if c.get("curve_note")]
        verdicts = [v for c in mine for v in c["verdicts"]]
        if verdicts:
            lines += ["### Properties", "", *_md_table(
                ["strategy", "dtype", "property", "verdict", "examples", "worst figure / bound", "input"],
                [[v["strategy"], v["dtype"], v["property"], VERDICT_CELLS.get(v["status"], v["status"]),
                  str(v.get("examples", 0)) + (f" (+{v['declined']} declined)" if v.get("declined") else "")
                  + (" (budget)" if v.get("budget_spent") else ""), v.get("figure_text", ""),
                  f"`{v['case']}`" if v.get("case") else (v.get("detail") or "")[:120]] for v in verdicts]), ""]
        imprecise = [v for v in verdicts if v["status"] == IMPRECISE]
        if imprecise:
            lines += ["### Imprecise", "", "Above the accuracy bound, within the correctness bound: the right function, "
                      "less accurately than the bound allows" + (" (fails the campaign under --strict)." if strict else "."), ""]
            lines += [f"- **{v['property']}** ({v['strategy']}, {v['dtype']}): {v['figure_text']}"
                      + (f"; worst input `{v['case']}`" if v.get("case") else "") + "." for v in imprecise]
            lines.append("")
        failures = [(c, v) for c in mine for v in c["verdicts"] if v["status"] in ("failed", "refused", "error")]
        if failures:
            lines += ["### Failures", ""]
            for c, v in failures:
                kind, reason = classify(v, who)
                lines += [f"- **{v['property']}** ({v['strategy']}, {v['dtype']}): {v.get('figure_text') or v['status']}"
                          + (f"; minimal counterexample `{v['case']}`" if v.get("case") else "")
                          + (f" (found as `{v['found']}`)" if v.get("found") and v["found"] != v.get("case") else "")
                          + f". {KIND_WORDS[kind]}: {reason}.",
                          f"  - {(v.get('detail') or '')[:400]}" if v.get("detail") else ""]
                key = f"{v['strategy']}/{v['dtype']}/{v['property']}"
                title = f"{kernel['op']}: {v['property']} ({v['strategy']}, {v['dtype']})"
                base = v["property"].partition("[")[0]
                if kind == "bug" and key in c["repro"] and not any(t.startswith(f"{kernel['op']}: {base}") for t, *_ in bugs):
                    bugs.append((title, c["repro"][key], reason))
            lines.append("")
    if bugs:
        lines += ["## Reproducing the bugs", "",
                  "Each script runs on a machine with the library and attnlab installed; it calls the kernel through "
                  "its declared convention on the minimal counterexample and prints the check's report (exit 1 while "
                  "the failure reproduces).", ""]
        for title, script, why in bugs:
            lines += [f"### {title}", "", f"{why}.", "", "```python", script.rstrip(), "```", ""]
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text("\n".join(line for line in lines if line is not None).rstrip() + "\n")
    return EXIT_HELD if table and all(cell_passed(c["status"], strict) for c in table) else EXIT_FAILED


def load_summary(results: Path) -> dict[str, Any] | None:
    """The plan with the results in ``results/`` now (folders merged by copying their results together, or a run
    cut off before writing campaign.json), with campaign.json's runs; campaign.json alone where there is no plan;
    None when there is neither."""
    stored = json.loads((results / SUMMARY_NAME).read_text()) if (results / SUMMARY_NAME).exists() else None
    if (results / PLAN_NAME).exists():
        plan = json.loads((results / PLAN_NAME).read_text())
        return summarize(results, plan, stored["runs"] if stored else [])
    return stored


def render_and_say(results: Path, destination: Path, strict: bool, preface: str = "") -> int:
    summary = load_summary(results)
    assert summary is not None
    status = render(summary, destination, strict, preface)
    counts = status_counts([c["status"] for c in cells(summary)])
    print(f"{counts}\nwrote {destination}; " + ("every cell ran completely and none failed" if status == EXIT_HELD
                                                  else "a cell failed, erred or did not run completely, or was "
                                                       "imprecise under --strict"))
    return status


def render_command(results: Path, report: Path | None, strict: bool, preface: Path | None = None) -> int:
    if load_summary(results) is None:
        return usage_error("campaign", f"--render {results}: no {SUMMARY_NAME} and no {PLAN_NAME} there")
    if preface is not None and not preface.is_file():
        return usage_error("campaign", f"--preface {preface}: no such file")
    return render_and_say(results, report or results / REPORT_NAME, strict, preface.read_text() if preface else "")
