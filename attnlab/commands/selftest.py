"""``attnlab selftest``: proof that the property suite catches broken kernels and passes correct ones.

Runs the default kernel property suite (attnlab.properties.suite) on every
known-bad specimen (attnlab.properties.specimens: forward specimens, a wrong
o, held to the forward's properties; backward specimens, the right o and a
wrong gradient, held to the forward's and the backward's) and on every
attnlab kernel that exists (the backward's properties where it is
differentiable), in each dtype, and prints the sensitivity table: for each
specimen, which properties caught it and after how many examples; for each
correct kernel, whether any property flagged it. Verdicts are graded
(attnlab.properties.checks): a specimen is caught when its expected property
is *failed* on some input (an imprecise verdict alone is an escape: the
defect must read as a wrong answer, not as a less accurate one); a correct
kernel is flagged by any verdict other than *held*. Below the tables: the
smallest excess a caught defect produced and the largest a correct kernel
did, per dtype (what the registry's correctness bounds are set between).

Exit status: 0 when every specimen is caught and no correct kernel is
flagged; 1 when one escapes or one is flagged (or the harness broke);
2 for a usage error (unknown formulation, bad dtype, nothing to run).

The search is derandomized (the same inputs every run) and does not shrink
(the first failure is what is counted). On a machine without a GPU the
kernels run under the Triton interpreter in fp16 and fp32 at small sizes;
``--jobs`` spreads the targets over processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, settings

from attnlab.commands.report import dtypes_arg, formulations_arg
from attnlab.evaluate import parse_dtype
from attnlab.properties.checks import EXCESS_MEASURE, GRADIENT_MEASURE
from attnlab.properties.strategies import Sizes

__all__ = ["add_parser", "run_selftest", "Row", "SELFTEST_SIZES", "DEFAULT_EXAMPLES", "suite_passes"]

DEFAULT_EXAMPLES = 4
# Small enough for the interpreter; T up to 40 still spans two 16-token chunks and a partial one.
SELFTEST_SIZES = Sizes(max_T=40, max_dim=16, max_H=2)


@dataclass(frozen=True)
class Job:
    """One target in one dtype: ``kind`` is "specimen" (``name`` a specimen) or "kernel" (``name/form``)."""

    kind: str
    name: str
    dtype: torch.dtype


@dataclass(frozen=True)
class Finding:
    """One property's search on one job, reduced to what the table shows.

    ``status`` is "held", "imprecise" (above the accuracy bound on an input,
    never above the correctness bound), "failed" (the property failed on an
    input) or "error" (the harness itself broke: never counted as a catch).
    ``figure`` and ``measure``: the failure's, the worst imprecise result's or
    the worst held one's figure; ``first_figure``: the figure of the first
    input on which the property did not hold (imprecise or failed), when it
    measured an excess like the failure's.
    """

    property: str
    status: str
    examples: int
    first_failure: int | None
    message: str
    worst: str = ""
    figure: float | None = None
    measure: str = ""
    first_figure: float | None = None


@dataclass(frozen=True)
class Row:
    """A job's findings, and for a specimen its defect and expected property."""

    job: Job
    label: str
    findings: tuple[Finding, ...]
    defect: str = ""
    expected: str = ""
    seconds: float = 0.0
    broken_pass: str = ""

    @property
    def caught_by(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "failed"]

    @property
    def imprecise(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "imprecise"]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "error"]

    @property
    def passed(self) -> bool:
        """A specimen passes when its expected property failed on it; a correct kernel when every property held."""
        if self.errors:
            return False
        if self.job.kind == "specimen":
            return any(f.property == self.expected for f in self.caught_by)
        return not self.caught_by and not self.imprecise


def _selftest_settings(examples: int) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
                    phases=(Phase.explicit, Phase.generate, Phase.target),
                    suppress_health_check=list(HealthCheck))


def _target(job: Job):
    from attnlab.properties.specimens import SPECIMENS
    from attnlab.properties.targets import function_target, own_kernel_target

    if job.kind == "specimen":
        specimen = next(s for s in SPECIMENS if s.name == job.name)
        return function_target(specimen.function, specimen.formulation, f"specimen:{specimen.name}"), specimen
    name, form = job.name.split("/")
    return own_kernel_target(name, form), None


def run_job(job: Job, examples: int, device: str) -> Row:
    """Every applicable property on one target in one dtype (runs in a worker process)."""
    from attnlab.properties import suite
    from attnlab.properties.checks import IMPRECISE, RAISED

    torch.set_num_threads(1)
    started = time.perf_counter()
    target, specimen = _target(job)
    findings = []
    for prop in suite.applicable(target, _passes(specimen)):
        outcome = suite.run(prop, target, job.dtype, device, SELFTEST_SIZES, _selftest_settings(examples))
        if outcome.errors:
            finding = Finding(prop.name, "error", outcome.examples, None, "\n".join(outcome.errors))
        elif outcome.failure is not None and outcome.failure.measure == RAISED and job.kind == "specimen":
            # A specimen that crashes has not been caught by the property: its harness is broken.
            finding = Finding(prop.name, "error", outcome.examples, None, outcome.failure.message())
        elif outcome.failure is not None:
            first = outcome.first_not_held
            finding = Finding(prop.name, "failed", outcome.examples, outcome.first_failure, outcome.failure.message(),
                              figure=outcome.failure.figure, measure=outcome.failure.measure,
                              first_figure=first.figure if first is not None
                              and first.measure == outcome.failure.measure else None)
        elif outcome.verdict == IMPRECISE and outcome.imprecise is not None:
            worst = outcome.imprecise
            finding = Finding(prop.name, "imprecise", outcome.examples, None, worst.message(),
                              f"{worst.figure:.2g}/{worst.bound:.2g}", worst.figure, worst.measure)
        else:
            worst = outcome.worst
            finding = Finding(prop.name, "held", outcome.examples, None, "",
                              f"{worst.figure:.2g}/{worst.bound:.2g}" if worst is not None else "",
                              worst.figure if worst is not None else None, worst.measure if worst is not None else "")
        findings.append(finding)
    return Row(job, target.label, tuple(findings), specimen.defect if specimen else "",
               specimen.expected_property if specimen else "", time.perf_counter() - started,
               specimen.broken_pass if specimen else "")


def suite_passes() -> tuple[str, ...]:
    """The passes the default suite checks (attnlab.properties.suite.PASSES): a specimen breaking a pass the
    suite does not check is not run."""
    from attnlab.properties import suite

    return tuple(suite.PASSES)


def _passes(specimen: Any) -> tuple[str, ...]:
    """The passes a target is held to: a forward specimen the forward's properties only (its backward is
    autograd through its wrong forward: no defect of its own); a backward specimen both (its forward must hold,
    its backward is caught); a correct kernel every pass the suite checks (the backward's where it is
    differentiable)."""
    from attnlab.properties.specimens import FORWARD

    if specimen is not None and specimen.broken_pass == FORWARD:
        return (FORWARD,)
    return suite_passes()


def _jobs(dtypes: list[torch.dtype], include: str, names: list[str] | None) -> list[Job]:
    from attnlab.properties.specimens import SPECIMENS
    from attnlab.properties.targets import own_kernel_targets

    jobs = []
    if include in ("all", "specimens"):
        passes = suite_passes()
        jobs += [Job("specimen", s.name, d) for s in SPECIMENS
                 if s.broken_pass in passes and (names is None or s.formulation in names) for d in dtypes]
    if include in ("all", "kernels"):
        for target in own_kernel_targets(names):
            jobs += [Job("kernel", target.label.removeprefix("attnlab:"), d) for d in dtypes if d in target.dtypes]
    return jobs


def _default_dtypes(device: str) -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float16, torch.float32]


def _positive(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def run_selftest(*, examples: int = DEFAULT_EXAMPLES, dtypes: list[torch.dtype] | None = None, include: str = "all",
                 names: list[str] | None = None, jobs: int = 1, device: str | None = None,
                 progress: bool = True) -> list[Row]:
    """Run the suite on every specimen and kernel; the rows in a stable order (specimens, then kernels)."""
    from tqdm import tqdm

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = dtypes or _default_dtypes(device)
    work = _jobs(dtypes, include, names)
    bar = tqdm(total=len(work), desc="selftest", unit="target", disable=not progress, file=sys.stderr)
    rows: dict[Job, Row] = {}
    if jobs <= 1 or device == "cuda":
        for job in work:
            bar.set_postfix_str(f"{job.name} {job.dtype}".replace("torch.", ""))
            rows[job] = run_job(job, examples, device)
            bar.update()
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(run_job, job, examples, device): job for job in work}
            for future in as_completed(futures):
                rows[futures[future]] = future.result()
                bar.update()
    bar.close()
    return [rows[job] for job in work]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# The excess measures whose extremes are shown, each with the suffix of its line's label.
EXTREME_MEASURES = {EXCESS_MEASURE: "", GRADIENT_MEASURE: " gradients"}


def _figure(f: Finding) -> str:
    return "" if f.figure is None else f" ({'excess ' if f.measure in EXTREME_MEASURES else ''}{f.figure:.3g})"


def _findings_text(row: Row) -> str:
    errors = [f"{f.property} ERROR" for f in row.errors]
    imprecise = [f"{f.property} IMPRECISE {f.examples} ({f.worst})" for f in row.imprecise]
    if row.caught_by or row.job.kind == "specimen":
        return ", ".join([f"{f.property} in {f.first_failure}{_figure(f)}" for f in row.caught_by]
                         + imprecise + errors) or "-"
    return ", ".join([f"{f.property} {f.examples} ({f.worst})" for f in row.findings if f.status == "held"]
                     + imprecise + errors)


def excess_extremes(rows: list[Row]) -> dict[str, dict[str, tuple[float, str] | None]]:
    """Per dtype (and per dtype for gradients, "float16 gradients"): the smallest finite excess (rel_err / floor) a
    caught specimen's defect produced where the property first did not hold (imprecise or failed: a defect's
    figure, whatever the bounds), and the largest a correct kernel reached, each with where: what the correctness
    bound (the forward's, the gradients') is set between."""
    extremes: dict[str, dict[str, tuple[float, str] | None]] = {}
    for row in rows:
        for f in row.findings:
            if f.measure not in EXTREME_MEASURES or f.figure is None:
                continue
            entry = extremes.setdefault(_dtype_name(row.job.dtype) + EXTREME_MEASURES[f.measure],
                                        {"smallest defect": None, "largest correct": None})
            where = f"{row.job.name}, {f.property}"
            if row.job.kind == "specimen" and f.status == "failed":
                figure = min(v for v in (f.figure, f.first_figure) if v is not None)
                if figure < float("inf") and (entry["smallest defect"] is None or figure < entry["smallest defect"][0]):
                    entry["smallest defect"] = (figure, where)
                continue
            if f.figure != f.figure or f.figure == float("inf"):
                continue
            if row.job.kind == "kernel" and f.status in ("held", "imprecise"):
                if entry["largest correct"] is None or f.figure > entry["largest correct"][0]:
                    entry["largest correct"] = (f.figure, where)
    return extremes


def extremes_text(rows: list[Row]) -> list[str]:
    lines = []
    for dtype, entry in excess_extremes(rows).items():
        parts = [f"{label} {value[0]:.3g} ({value[1]})" for label, value in entry.items() if value is not None]
        if parts:
            lines.append(f"  {dtype}: " + "; ".join(parts))
    return (["Excess extremes (the correctness bound sits between them; attnlab.registry.BOUNDS):", *lines]
            if lines else [])


def table(rows: list[Row]) -> str:
    """The sensitivity table, plain text."""
    lines = []
    specimens = [r for r in rows if r.job.kind == "specimen"]
    kernels = [r for r in rows if r.job.kind == "kernel"]
    if specimens:
        lines.append("Specimens (each must be caught by its expected property; 'in N' = examples to the first failure)")
        header = ("specimen", "dtype", "breaks", "defect", "expected", "verdict", "caught by")
        body = [(r.job.name, _dtype_name(r.job.dtype), r.broken_pass, r.defect, r.expected,
                 "caught" if r.passed else "ESCAPED", _findings_text(r)) for r in specimens]
        lines += _aligned(header, body)
        lines.append("")
    if kernels:
        lines.append("Correct kernels (none may be flagged; per property: examples run (worst figure/bound))")
        header = ("kernel", "dtype", "seconds", "verdict", "properties")
        body = [(r.label, _dtype_name(r.job.dtype), f"{r.seconds:.0f}", "ok" if r.passed else "FLAGGED", _findings_text(r))
                for r in kernels]
        lines += _aligned(header, body)
    extremes = extremes_text(rows)
    if extremes:
        lines += ["", *extremes]
    return "\n".join(lines)


def _aligned(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    fmt = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body)]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``attnlab selftest`` on the CLI's subparsers."""
    parser = subparsers.add_parser("selftest", help="show that the property suite catches broken kernels and passes correct ones")
    parser.add_argument("--examples", type=_positive, default=DEFAULT_EXAMPLES, help="examples per property and target")
    parser.add_argument("--dtypes", type=dtypes_arg, default=None,
                        help="comma-separated; default float16,float32 on the CPU, bfloat16,float16 on a GPU")
    parser.add_argument("--only", choices=["all", "specimens", "kernels"], default="all", help="which targets")
    parser.add_argument("--formulations", type=formulations_arg, default=None,
                        help="'all' or comma-separated formulation names (default: all)")
    parser.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1, help="worker processes (CPU only)")
    parser.add_argument("--verbose", action="store_true", help="print every failure report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_command)
    return parser


def _command(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    dtypes = [parse_dtype(d) for d in args.dtypes] if args.dtypes else None
    names = args.formulations
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not _jobs(dtypes or _default_dtypes(device), args.only, names):
        print(f"attnlab selftest: error: nothing to run: no {'target' if args.only == 'all' else args.only[:-1]} of "
              f"{', '.join(names or ['any formulation'])} runs in {', '.join(args.dtypes or ['the default dtypes'])} "
              f"here (attnlab's kernels cannot run bfloat16 under the Triton interpreter)", file=sys.stderr)
        return 2
    rows = run_selftest(examples=args.examples, dtypes=dtypes, include=args.only, names=names, jobs=args.jobs,
                        device=device, progress=not args.no_progress)
    print(table(rows))
    bad = [r for r in rows if not r.passed]
    for row in rows:
        if args.verbose or not row.passed:
            shown = row.caught_by if args.verbose or row.job.kind == "kernel" else []
            for finding in row.errors + row.imprecise + shown:
                print(f"\n--- {row.label} ({_dtype_name(row.job.dtype)}): {finding.property}\n{finding.message}")
    where = "GPU" if torch.cuda.is_available() else "CPU, Triton interpreter"
    print(f"\n{len(rows)} runs, {sum(not r.passed for r in rows)} failed; {time.perf_counter() - started:.0f} s ({where})")
    return 0 if not bad else 1


def _standalone(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["selftest", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(_standalone())
