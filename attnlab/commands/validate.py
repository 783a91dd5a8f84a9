"""``attnlab validate``: the property suite and the error-vs-length curve, on a kernel someone else wrote.

    attnlab validate --formulation gla --kernel mypkg.ops:my_gla --convention fla --device cuda --dtype bfloat16
    attnlab validate --fla-op chunk_gla --device cuda            # fla 0.6.0's own kernel, its convention
    attnlab validate --formulation kda --kernel ./my_kda.py:kda --convention auto

The kernel (``MODULE:FUNCTION``, MODULE importable or a path to a ``.py``
file) is called in its own convention, translated by an adapter
(attnlab.conventions): ``attnlab`` (FORMULATIONS.md keywords, the plugin's
convention), ``fla`` (flash-linear-attention 0.6.0's convention of the fla
function of that name, or of ``--fla-op``, or the one its signature fits),
``peer`` (the convention the registry declares for that function among the
formulation's peers: torch's SDPA backends in attnlab.third_party, say) or
``auto`` (tried on small inputs against the oracle: gates log or linear,
scale passed, ``K**-0.5`` or 1, returns, keywords or FORMULATIONS.md's
positional order, state ``[K, V]`` or ``[V, K]``, the final-state flag; the
one found is printed, and none found exits 1).

Every applicable property of attnlab.properties.suite runs under each
strategy:

- ``default``: the registry's default input distributions, over shapes,
  seeds and options (T = 1, chunk edges, odd head dims, split points); the
  ``overflow`` property, adversarial by nature, runs only under
  ``adversarial``;
- ``adversarial``: the suite's own strategies, which push gates to -20 per
  step, beta to 0 and 2, keys nearly parallel, logits and keys past the
  dtype's exp overflow, and the kept regressions.

The search does not shrink (hypothesis' shrinking replays a kernel hundreds
of times); a failure is instead minimized greedily (batch and heads to 1,
distribution parameters back to the defaults, shorter T, smaller head dims,
each kept only while the property still fails), and the minimal case is
reported.

Verdicts (attnlab.properties.checks): an error-measuring property is
*held* within the registry's accuracy bound for the dtype (``--bound X``
replaces it), *imprecise* above it up to the correctness bound, *failed*
above that, with a non-finite output, or when the kernel raised; exact
properties (causality, convexity) are held or failed. The search goes on
past an imprecise input looking for a failure. A kernel that raises
NotImplementedError declines that input (the table counts them: "4 (+2
declined)") and the search draws another; one that declines every input is
*refused*.

Printed: the convention, then the verdict table (strategy, dtype, property,
verdict, examples, the worst figure against its bounds, the reproducing
Case), then each failure's report with a standalone script that reproduces it
(unindented between two cut lines: saved as a file and run with python, it
calls the kernel in its own convention, prints the figure and exits 1 while
the failure reproduces). Under ``auto``, when no candidate matches, what was
tried and the closest candidates with their errors (or what the first raised);
when one matched but a property then fails, a note that the convention was
detected on the small probe inputs and that ``--convention`` given explicitly
rules the detection out. Written
to ``--out DIR``: ``report.json`` (verdicts, convention, detection, device,
versions, the FLA_* environment variables that change fla's numerics, the
curve's rows), ``summary.md`` (the same, readable), and ``curve/`` (the
error-vs-length rows, plot and index.md of attnlab.commands.report, with attnlab's own
kernels and the naive recurrences side by side under ``--compare``).

Passes (``--passes``): ``forward`` judges the output, ``backward`` the gradients (attnlab.properties.checks'
backward properties, one verdict row per (property, gradient): ``backward_matches_oracle[dq]``...); the default
is both when the kernel is differentiable (called on inputs that require grad, its output requires grad), else
forward. ``--passes backward`` on a kernel that is not differentiable is a usage error. A kernel whose backward
raises (fla's gated ops refuse theirs on Hopper with older Triton) gets the verdict ``refused`` with the kernel's
message on each backward row: it is not a crash, and it counts as failed for the exit status (the backward the
user asked to have judged could not be judged; ``--passes forward`` judges the forward alone).

Exit status: 0 when no property failed (imprecise ones pass, unless
``--strict``); 1 when one failed (or raised, or its backward refused, or was not run within
``--time-budget``), when the kernel's own error-vs-length point failed, when
``--strict`` and one was imprecise, or when ``--convention auto`` found no
convention; 2 for a usage error (bad MODULE:FUNCTION, unknown formulation or
fla op, bad dtype, ``--device cuda`` without a GPU, a ``--bound`` that is not
a positive number or is given for more than one dtype, ``--passes backward`` on a kernel that is not
differentiable).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from attnlab.commands import report
from attnlab.conventions import (ATTNLAB, CONVENTION_CHOICES, DETECT_SIZES, DETECT_TOLERANCE, FLA, FLA_NUMERICS_ENV,
                                 ConventionError, Convention, choose_convention, choose_fla_convention,
                                 describe_detection, detection_caveat, fixed_scale)
from attnlab.commands import EXIT_FAILED, EXIT_HELD, EXIT_USAGE, usage_error
from attnlab.kernel import interpreter_active  # first: it sets TRITON_INTERPRET=1 without a GPU
from attnlab.registry import formulation, names

__all__ = ["EXIT_HELD", "EXIT_FAILED", "EXIT_USAGE", "STRATEGIES", "UsageError", "Verdict", "Validation", "load_kernel",
           "fla_kernel", "choose_fla_convention", "make_target", "validate", "verdict_table", "write_outputs",
           "add_parser"]

STRATEGIES = ("default", "adversarial")
CONVENTIONS = CONVENTION_CHOICES
# Examples per (strategy, dtype, property) when --examples is not given, by --profile (the plugin's profiles).
PROFILE_EXAMPLES = {"ci": 25, "dev": 50, "gpu": 200, "thorough": 2000}
# --convention auto: DETECT_SIZES and DETECT_TOLERANCE (attnlab.conventions, shared with the pytest plugin).
# The error-vs-length curve when --lengths / --curve-shape are not given.
CURVE_DEFAULTS = {
    "cpu": ((16, 32, 64, 128), report.Sizes(B=1, H=2, K=16, V=16)),
    "cuda": ((64, 256, 1024, 4096, 16384), report.Sizes(B=1, H=4, K=64, V=64)),
}
MINIMIZE_TRIES = 24
MINIMIZE_SECONDS = 60.0
# The distribution parameters of a Case and their defaults (the registry's default distributions).
DISTRIBUTION = {"gate_low": None, "beta_low": None, "beta_high": None, "key_norm": 1.0, "key_coherence": 0.0,
                "spread": 1.0, "logit_max": None, "key_shift": 0.0}


# A bad command line: exit status 2. The conventions' own errors (attnlab.conventions.choose_convention, shared
# with the pytest plugin) are usage errors too.
UsageError = ConventionError


# ----------------------------------------------------------------------------- resolving the kernel


def load_kernel(spec: str) -> Callable[..., Any]:
    """The callable named ``MODULE:FUNCTION`` (attnlab.properties.targets.load_callable), or a UsageError."""
    from attnlab.properties.targets import load_callable

    try:
        return load_callable(spec, "--kernel")
    except ValueError as error:
        raise UsageError(str(error)) from error


def fla_kernel(op: str, name: str | None = None) -> tuple[str, str]:
    """``(formulation, MODULE:FUNCTION)`` of fla 0.6.0's kernel ``op`` (``--fla-op``)."""
    owners = [n for n, table in FLA.items() if op in table]
    if not owners:
        known = sorted({fn for table in FLA.values() for fn in table})
        raise UsageError(f"--fla-op {op!r}: not a kernel attnlab knows fla's convention of; known: {', '.join(known)}")
    if name is None:
        name = owners[0]  # fused_recurrent_gla: gla first (general is the same function with gv)
    elif name not in owners:
        raise UsageError(f"--fla-op {op} computes {' or '.join(owners)}, not {name}")
    return name, formulation(name).peer("fla", op).function


def make_target(kernel: Callable[..., Any], name: str, label: str, convention: Convention):
    """The property suite's Target for ``kernel``, called in ``convention`` (attnlab.properties.targets.convention_target)."""
    from attnlab.properties.targets import convention_target

    return convention_target(kernel, name, label, convention)


# ----------------------------------------------------------------------------- cases


def _snap(value: int, choices: Sequence[int]) -> int:
    return min(choices, key=lambda c: (abs(c - value), c))


def make_fit(target_name: str, convention: Convention, strategy: str, prop: str,
             dims: Sequence[int] | None) -> Callable[[Any], Any]:
    """The edit applied to every case of ``prop`` under ``strategy`` for a kernel in ``convention``.

    ``default`` resets the distribution parameters (shift_invariance keeps its
    key shift: it is the property); a kernel's fixed scale is passed
    explicitly, its implied options forced, the arguments it derives itself
    left at the registry's default; ``dims`` restricts K and V (fla
    recompiles and autotunes for each head dimension).
    """
    from attnlab.properties import traits

    target = formulation(target_name)
    derived_gate = any(traits.is_log_gate(target.arg(a)) or traits.is_decay_rate(target.arg(a)) for a in convention.derived)
    derived_beta = any(traits.is_write_strength(target.arg(a)) for a in convention.derived)

    def fit(case: Any) -> Any:
        changes: dict[str, Any] = {}
        if strategy == "default":
            changes.update({k: v for k, v in DISTRIBUTION.items() if not (prop == "shift_invariance" and k == "key_shift")})
        if derived_gate:
            changes["gate_low"] = None
        if derived_beta:
            changes.update(beta_low=None, beta_high=None)
        if dims:
            changes.update(K=_snap(case.K, dims), V=_snap(case.V, dims))
        f = formulation(case.name)
        if "scale" in f.option_names and convention.scale != "pass":
            changes["scale"] = fixed_scale(convention, changes.get("K", case.K))
        if convention.implied and case.name == target_name:
            options = dict(case.options)
            options.update({k: v for k, v in convention.implied.items() if k in f.option_names})
            changes["options"] = tuple(sorted(options.items()))
        return case.with_(**changes)

    return fit


def minimize(prop: Any, target: Any, case: Any, result: Any, dtype: torch.dtype, device: str,
             fit: Callable[[Any], Any], *, tries: int = MINIMIZE_TRIES, seconds: float = MINIMIZE_SECONDS) -> tuple[Any, Any, int]:
    """A smaller failing case: greedy simplifications, each kept while the property still fails the same way.

    Returns ``(case, result, checks run)``. A failure by raising stays one
    (a simplification that only makes the kernel raise is not kept, and vice versa).
    """
    from attnlab.properties.checks import RAISED

    best, best_result = case, result
    raised = result.measure == RAISED
    runs = 0
    started = time.perf_counter()

    def budget_left() -> bool:
        return runs < tries and time.perf_counter() - started < seconds

    def attempt(candidate: Any) -> bool:
        nonlocal best, best_result, runs
        if candidate.cut is not None:
            if candidate.T < 2:
                return False
            candidate = candidate.with_(cut=min(max(candidate.cut, 1), candidate.T - 1))
        candidate = fit(candidate)
        if candidate == best or not budget_left():
            return False
        runs += 1
        try:
            outcome = prop.check(target, candidate, dtype, device)
        except Exception:  # noqa: BLE001 - a harness error on a simplified case: not kept
            return False
        if outcome.failed and (outcome.measure == RAISED) == raised:
            best, best_result = candidate, outcome
            return True
        return False

    attempt(best.with_(B=1, H=1)) or attempt(best.with_(B=1)) or attempt(best.with_(H=1))
    for name, default in (*DISTRIBUTION.items(), ("scale", None), ("absent", ())):
        if name == "beta_high" or getattr(best, name) == default:
            continue
        if name == "key_shift" and prop.name == "shift_invariance":
            continue
        changes = {"beta_low": None, "beta_high": None} if name == "beta_low" else {name: default}
        attempt(best.with_(**changes))
    for T in sorted({1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, best.T // 4, best.T // 2}):
        if 1 <= T < best.T and attempt(best.with_(T=T)):
            break
    for axis in ("K", "V"):
        for size in sorted({1, 2, 4, 8, 16, 32, 64, getattr(best, axis) // 2}):
            if 1 <= size < getattr(best, axis) and attempt(best.with_(**{axis: size})):
                break
    if best.cut is not None:
        for cut in (best.T - 1, 1, best.T // 2):
            if cut != best.cut and attempt(best.with_(cut=cut)):
                break
    return best, best_result, runs


# ----------------------------------------------------------------------------- running


@dataclass
class Verdict:
    """One property under one strategy in one dtype.

    ``status``: "held", "imprecise" (above the accuracy bound on an input,
    never above the correctness bound: ``case``), "failed" (on an input:
    ``case``), "refused" (the backward raised, or the kernel declined every
    input: its message), "error" (the harness broke; counted as failed) or
    "skipped" (not run within the time budget). ``declined`` counts the
    inputs the kernel declined (NotImplementedError), which the search skipped. ``figure``/``bound``/``correctness``:
    the failure's, the worst imprecise figure's or the worst held figure's
    (``correctness`` None for exact properties); ``case`` the reproducing
    input (minimized for a failure; ``found`` is the one the search found
    first).
    """

    strategy: str
    dtype: str
    property: str
    status: str
    examples: int = 0
    figure: float | None = None
    bound: float | None = None
    measure: str = ""
    case: str = ""
    found: str = ""
    first_failure: int | None = None
    minimize_checks: int = 0
    detail: str = ""
    message: str = ""
    seconds: float = 0.0
    correctness: float | None = None
    budget_spent: bool = False  # the search stopped at its time budget, before its examples
    declined: int = 0  # inputs the kernel declined (NotImplementedError), skipped by the search

    @property
    def held(self) -> bool:
        return self.status == "held"

    @property
    def gradient(self) -> str | None:
        """The gradient a backward property's row is about (``dq`` of ``backward_matches_oracle[dq]``), else None."""
        return self.property.partition("[")[2].rstrip("]") or None

    @property
    def pass_name(self) -> str:
        return "backward" if self.property.startswith("backward_") else "forward"

    @property
    def failed(self) -> bool:
        """Failed, refused (the backward raised), broke the harness or was not run: what makes ``attnlab validate``
        exit 1 whatever --strict says."""
        return self.status in ("failed", "refused", "error", "skipped")

    def figure_text(self) -> str:
        if self.figure is None and self.status in ("held", "failed") and self.measure:
            return "none (raised)" if "raised" in self.measure else "inf"
        if self.figure is None:
            return ""
        short = {"excess = rel_err / floor": "excess", "final state rel_err": "state rel_err",
                 "output entries before the cut that changed": "entries changed",
                 "|o_c1 - o_c2| / |ref| / floor": "chunk difference / floor",
                 "max distance outside [min v, max v] / max |v|": "outside [min v, max v]"}.get(self.measure, self.measure)
        if self.correctness is None:
            return f"{self.figure:.3g} / {self.bound:.3g} ({short})"
        return f"{self.figure:.3g} / {self.bound:.3g} ({short}; failed above {self.correctness:.3g})"


@dataclass
class Validation:
    """Everything ``attnlab validate`` found: what it ran on, the verdicts and the curve."""

    kernel: str
    formulation: str
    convention: Convention | None
    device: str
    dtypes: list[str]
    strategies: list[str]
    examples: int
    sizes: dict[str, Any]
    verdicts: list[Verdict] = field(default_factory=list)
    detection: dict[str, Any] | None = None
    detection_text: str = ""
    curve: list[dict[str, Any]] = field(default_factory=list)
    curve_settings: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    command: str = ""
    repro: dict[str, str] = field(default_factory=dict)  # verdict key -> reproducing script
    strict: bool = False  # an imprecise verdict fails the run
    bound: float | None = None  # the user's accuracy bound (--bound), None for the registry's
    passes: list[str] = field(default_factory=lambda: ["forward"])  # the passes judged
    differentiable: bool | None = None  # whether the kernel's output requires grad when its inputs do

    def curve_verdicts(self) -> list[str]:
        """The verdicts of the kernel's own error-vs-length points (not those of the implementations beside it)."""
        from attnlab.commands.report import row_verdict

        return [row_verdict(r) for r in self.curve if r["impl"] == self.kernel]

    @property
    def verdict(self) -> str:
        """held, imprecise or failed: the worst of the property runs (an error or a run not made counts as failed)
        and of the kernel's own curve points; failed when no convention matched or nothing ran."""
        from attnlab.metrics import FAILED, worst_verdict

        if self.convention is None or not self.verdicts:
            return FAILED
        return worst_verdict([FAILED if v.failed else v.status for v in self.verdicts] + self.curve_verdicts())

    @property
    def exit_code(self) -> int:
        verdict = self.verdict
        return EXIT_HELD if verdict == "held" or (verdict == "imprecise" and not self.strict) else EXIT_FAILED


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _search_settings(examples: int):
    from hypothesis import HealthCheck, Phase, settings

    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
                    phases=(Phase.explicit, Phase.generate, Phase.target), suppress_health_check=list(HealthCheck))


def verdict_key(v: Verdict) -> str:
    return f"{v.strategy}/{v.dtype}/{v.property}"


def run_property(prop: Any, target: Any, dtype: torch.dtype, device: str, sizes: Any, strategy: str, examples: int,
                 convention: Convention, dims: Sequence[int] | None, minimize_tries: int, *,
                 replay: Sequence[Any] = (), deadline: float | None = None) -> Verdict:
    """One property's search under one strategy, reduced to a Verdict (a failure minimized; the search goes on
    past imprecise inputs, and the worst imprecise one is reported when no input failed). ``replay`` cases run
    first; past ``deadline`` (``time.monotonic()``) the search stops drawing (attnlab.properties.suite.search)."""
    from attnlab.properties import suite
    from attnlab.properties.checks import BACKWARD_RAISED, DECLINED

    started = time.perf_counter()
    fit = make_fit(target.formulation, convention, strategy, prop.name, dims)
    outcome = suite.run(prop, target, dtype, device, sizes, _search_settings(examples), fit=fit,
                        regressions=strategy == "adversarial", replay=replay, deadline=deadline)
    verdict = Verdict(strategy, _dtype_name(dtype), prop.name, "held", outcome.examples,
                      budget_spent=outcome.budget_spent, declined=outcome.declined)
    if outcome.failure is not None and outcome.failure.measure in (BACKWARD_RAISED, DECLINED):
        # The kernel's backward raised, or it declined every input: its message, as found (nothing to minimize).
        verdict.status = "refused"
        verdict.first_failure = outcome.first_failure
        chosen = outcome.failure
    elif outcome.failure is not None:
        failure = outcome.failure
        case, result, runs = failure.case, failure, 0
        # A CUDA fault loses the process's context: every smaller case would fail the same way (suite's docstring).
        if minimize_tries > 0 and case is not None and outcome.cuda_fault is None:
            seconds = MINIMIZE_SECONDS if deadline is None else min(MINIMIZE_SECONDS, max(5.0, deadline - time.monotonic()))
            case, result, runs = minimize(prop, target, case, failure, dtype, device, fit, tries=minimize_tries,
                                          seconds=seconds)
        verdict.status = "failed"
        verdict.first_failure = outcome.first_failure
        verdict.found = repr(failure.case)
        verdict.minimize_checks = runs
        chosen = result
    elif outcome.errors:
        verdict.status = "error"
        verdict.detail = "\n".join(outcome.errors)
        verdict.message = verdict.detail
        chosen = outcome.worst
    elif outcome.imprecise is not None:
        verdict.status = "imprecise"
        chosen = outcome.imprecise
    else:
        chosen = outcome.worst
    if chosen is not None:
        verdict.figure, verdict.bound, verdict.measure = _finite(chosen.figure), chosen.bound, chosen.measure
        verdict.correctness = chosen.correctness
        verdict.case = repr(chosen.case) if chosen.case is not None else ""
        if verdict.status != "error":
            verdict.detail, verdict.message = chosen.detail, chosen.message()
    verdict.seconds = round(time.perf_counter() - started, 2)
    return verdict


def smoke_call(target: Any, name: str, dtype: torch.dtype, device: str, convention: Convention,
               dims: Sequence[int] | None = None) -> None:
    """One call on small default inputs (attnlab.properties.targets.smoke_check): a TypeError there, or an output
    that is not a tensor of the oracle's shape, means the kernel is not called like ``convention`` says (a usage
    error, not a property of the kernel)."""
    fit = make_fit(name, convention, "default", "matches_oracle", None)
    from attnlab.properties.strategies import Case

    from attnlab.properties.targets import smoke_check

    size = dims[0] if dims else 16  # a head dim the search draws anyway: no extra Triton compile
    case = fit(Case(name=name, T=4, H=1, K=size, V=size))
    try:
        smoke_check(target, case.call(dtype, device), convention)
    except ValueError as error:
        raise UsageError(str(error)) from error


def properties_for(target: Any, convention: Convention, strategy: str, only: Sequence[str] | None,
                   passes: Sequence[str] = ("forward",), assume_differentiable: bool = False) -> list[Any]:
    """The applicable properties of ``passes`` under ``strategy`` (overflow only when adversarial); ``only`` names
    properties (a backward property by its check, ``backward_matches_oracle``, or with its gradient);
    ``assume_differentiable`` as attnlab.properties.suite.applicable's."""
    from attnlab.properties import suite

    chosen = []
    for prop in suite.applicable(target, tuple(passes), assume_differentiable=assume_differentiable):
        if strategy == "default" and prop.name == "overflow":
            continue
        if prop.name == "reduces_to_special_case" and convention.derived:
            continue  # the special case sets an argument this kernel computes itself
        gradient = prop.name.partition("[")[2].rstrip("]")
        if gradient and gradient[1:] in convention.derived:
            continue  # no gradient for an argument the kernel computes itself (fla's chunk_retention's g)
        if only and prop.name not in only and suite.base_name(prop.name) not in only:
            continue
        chosen.append(prop)
    return chosen


def curve_implementations(name: str, dtype: str, label: str, call: Callable[..., Any], compare: bool,
                          device: str) -> list[report.Implementation]:
    """The kernel under test, and with ``compare`` attnlab's kernels that run here and the naive recurrences."""
    impls = [report.Implementation(label, lambda: call)]
    if not compare:
        return impls
    f = formulation(name)
    own_ok = importlib.util.find_spec(f.kernel_module) is not None and not (interpreter_active() and dtype == "bfloat16")
    for impl in report.implementations(f, dtype):
        if impl.name.startswith("attnlab:") and not own_ok:
            continue
        impls.append(impl)
    return impls


def error_curve(name: str, call: Callable[..., Any], label: str, dtypes: Sequence[str], lengths: Sequence[int],
                sizes: report.Sizes, device: str, *, compare: bool, options: dict[str, Any] | None, seed: int = 0,
                progress: Any = None) -> list[dict[str, Any]]:
    """attnlab.commands.report's rows (excess at each length) for the kernel and, with ``compare``, attnlab's own."""
    f = formulation(name)
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        impls = curve_implementations(name, dtype, label, call, compare, device)
        for T in lengths:
            if progress is not None:
                progress.set_postfix_str(f"curve {dtype} T={T}")
            rows += report.measure_point(f, dtype, T, sizes, impls, seed=seed, device=device, extra={"run": 0},
                                         options=options)
            if progress is not None:
                progress.update()
    return rows


REPRO_CUT = "# ---8<--- cut here: the reproducing script starts on the next line ---"
REPRO_END = "# ---8<--- cut here: the reproducing script ends on the line above ---"


def _kernel_import(spec: str) -> tuple[str, str]:
    """Lines importing the kernel in a standalone script, and the expression naming it. A module that is not
    installed (found on the current directory or PYTHONPATH) gets its folder put on sys.path, so the script runs
    from anywhere."""
    module_name, _, attribute = spec.rpartition(":")
    first = attribute.split(".")[0]
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name).resolve()
        return (f"import sys\nsys.path.insert(0, {str(path.parent)!r})\nfrom {path.stem} import {first}", attribute)
    module = sys.modules.get(module_name)
    source = getattr(module, "__file__", None)
    if source and "site-packages" not in source and "dist-packages" not in source:
        root = Path(source).resolve().parent
        for _ in range(module_name.count(".") + (Path(source).name == "__init__.py")):
            root = root.parent
        return f"import sys\nsys.path.insert(0, {str(root)!r})\nfrom {module_name} import {first}", attribute
    return f"from {module_name} import {first}", attribute


def _convention_expression(convention: Convention) -> str:
    for name, table in FLA.items():
        for function, c in table.items():
            if c == convention:
                return f"fla_convention({name!r}, {function!r})"
    return repr(convention)


def repro_script(validation: Validation, verdict: Verdict, accepts_state: bool) -> str:
    """A standalone script that re-runs the failed check on the reported case."""
    imports, expression = _kernel_import(validation.kernel)
    convention = validation.convention
    assert convention is not None
    if convention == ATTNLAB:
        build = f"kernel = {expression}  # attnlab's convention: called as it is"
    else:
        build = (f"kernel = adapt({expression}, {_convention_expression(convention)}, {validation.formulation!r})"
                 "  # the kernel, called in its own convention")
    check, _, gradient = verdict.property.partition("[")
    call = (f"checks.check_{check}(target, case, torch.{verdict.dtype}, {validation.device!r}"
            + (f", gradient={gradient.rstrip(']')!r})" if gradient else ")"))
    return "\n".join([
        f"# attnlab validate: {verdict.property} failed for {validation.kernel} ({validation.formulation}) in "
        f"{verdict.dtype} on {validation.device}, {verdict.strategy} strategy",
        "import torch",
        "from attnlab.conventions import Convention, adapt, fla_convention",
        "from attnlab.properties import checks",
        "from attnlab.properties.strategies import Case",
        "from attnlab.properties.targets import Target",
        imports,
        "",
        build,
        f"target = Target({validation.kernel!r}, {validation.formulation!r}, kernel, accepts_state={accepts_state})",
        f"case = {verdict.case}",
        f"result = {call}",
        "print(result.message())",
        "if __name__ == \"__main__\":",
        "    raise SystemExit(1 if result.failed else 0)  # 1: the failure reproduces",
        "",
    ])


def validate(kernel_spec: str, name: str, *, convention: str = "attnlab", fla_op: str | None = None,
             device: str = "cpu", dtypes: Sequence[torch.dtype] = (torch.float16,),
             strategies: Sequence[str] = STRATEGIES, examples: int = 25, sizes: Any = None,
             dims: Sequence[int] | None = None, only: Sequence[str] | None = None,
             lengths: Sequence[int] = (), curve_sizes: report.Sizes | None = None, compare: bool = True,
             minimize_tries: int = MINIMIZE_TRIES, time_budget: float | None = None, progress: bool = False,
             command: str = "", say: Callable[[str], None] = print, curve_first: bool = False,
             strict: bool = False, bound: float | None = None, passes: Sequence[str] | None = None) -> Validation:
    """Run the property suite and the error curve on ``kernel_spec`` (see the module's docstring).

    ``bound`` replaces the registry's accuracy bound (attnlab.metrics.user_bound) for the properties and the
    curve's verdicts; ``strict`` makes an imprecise verdict fail the run (``exit_code`` 1)."""
    from attnlab.metrics import user_bound

    with user_bound(bound):
        return _validate(kernel_spec, name, convention=convention, fla_op=fla_op, device=device, dtypes=dtypes,
                         strategies=strategies, examples=examples, sizes=sizes, dims=dims, only=only, lengths=lengths,
                         curve_sizes=curve_sizes, compare=compare, minimize_tries=minimize_tries,
                         time_budget=time_budget, progress=progress, command=command, say=say,
                         curve_first=curve_first, strict=strict, bound=bound, passes=passes)


def _validate(kernel_spec: str, name: str, *, convention: str, fla_op: str | None, device: str,
              dtypes: Sequence[torch.dtype], strategies: Sequence[str], examples: int, sizes: Any,
              dims: Sequence[int] | None, only: Sequence[str] | None, lengths: Sequence[int],
              curve_sizes: report.Sizes | None, compare: bool, minimize_tries: int, time_budget: float | None,
              progress: bool, command: str, say: Callable[[str], None], curve_first: bool, strict: bool,
              bound: float | None, passes: Sequence[str] | None = None) -> Validation:
    from tqdm import tqdm

    from attnlab.properties.suite import sizes_for

    started = time.perf_counter()
    if name not in names():
        raise UsageError(f"unknown formulation {name!r}; expected one of {', '.join(names())}")
    kernel = load_kernel(kernel_spec)
    sizes = sizes or sizes_for(device, "ci")
    validation = Validation(kernel_spec, name, None, device, [_dtype_name(d) for d in dtypes], list(strategies), examples,
                            asdict(sizes), command=command, strict=strict, bound=bound)
    chosen, found = choose_convention(convention, kernel, name, kernel_spec, fla_op=fla_op, dtype=dtypes[0],
                                      device=device)
    if found is not None:
        validation.detection = {"errors": {k: _finite(v) for k, v in found.errors.items()}, "raised": found.raised,
                                "tolerance": DETECT_TOLERANCE[dtypes[0]], "dtype": _dtype_name(dtypes[0]),
                                "sizes": DETECT_SIZES}
        validation.detection_text = describe_detection(found, dtypes[0])
        say(validation.detection_text)
    if chosen is None:
        validation.seconds = round(time.perf_counter() - started, 1)
        return validation
    validation.convention = chosen
    say(f"kernel: {kernel_spec} as {name}; convention {chosen.describe()}")
    target = make_target(kernel, name, kernel_spec, chosen)
    smoke_call(target, name, dtypes[0], device, chosen, dims)
    validation.differentiable = target.differentiable
    if passes is None:
        passes = ["forward", "backward"] if target.differentiable else ["forward"]
    elif "backward" in passes and not target.differentiable:
        from attnlab.properties.targets import PROBE_NOTES

        why = PROBE_NOTES.get(target.label, "called on inputs that require grad, its output does not require grad")
        raise UsageError(f"--passes backward: {kernel_spec} is not differentiable ({why}), so it has no backward to "
                         "judge; use --passes forward")
    validation.passes = list(passes)
    say(f"passes: {', '.join(passes)} (the kernel is {'' if target.differentiable else 'not '}differentiable)")
    plan = [(dtype, strategy, prop) for dtype in dtypes for strategy in strategies
            for prop in properties_for(target, chosen, strategy, only, passes)]
    curve_lengths = list(lengths)
    curve_dtypes = validation.dtypes if curve_lengths else []
    bar = tqdm(total=len(plan) + len(curve_lengths) * len(curve_dtypes), desc="attnlab validate", unit="step",
               disable=not progress, file=sys.stderr)
    def measure_curve() -> None:
        nonlocal curve_sizes
        if curve_lengths:
            if time_budget is not None and time.perf_counter() - started > time_budget:
                say(f"curve: not measured (past --time-budget {time_budget:g} s)")
            else:
                K = (curve_sizes or CURVE_DEFAULTS[device][1]).K
                fixed = fixed_scale(chosen, K) if "scale" in formulation(name).option_names else None
                curve_sizes = curve_sizes or CURVE_DEFAULTS[device][1]
                validation.curve_settings = {"lengths": curve_lengths, "sizes": asdict(curve_sizes), "seed": 0,
                                             "compare": compare, "options": {"scale": fixed} if fixed is not None else {}}
                validation.curve = error_curve(name, lambda **x: target(**x), kernel_spec, curve_dtypes, curve_lengths,
                                               curve_sizes, device, compare=compare,
                                               options=validation.curve_settings["options"] or None, progress=bar)

    if curve_first:
        measure_curve()
    for dtype, strategy, prop in plan:
        if time_budget is not None and time.perf_counter() - started > time_budget:
            validation.verdicts.append(Verdict(strategy, _dtype_name(dtype), prop.name, "skipped",
                                               detail=f"not run: past --time-budget {time_budget:g} s"))
            bar.update()
            continue
        bar.set_postfix_str(f"{_dtype_name(dtype)} {strategy} {prop.name}")
        verdict = run_property(prop, target, dtype, device, sizes, strategy, examples, chosen, dims, minimize_tries)
        validation.verdicts.append(verdict)
        if verdict.status == "failed":
            validation.repro[verdict_key(verdict)] = repro_script(validation, verdict, target.accepts_state)
        bar.update()
    if not curve_first:
        measure_curve()
    bar.close()
    validation.seconds = round(time.perf_counter() - started, 1)
    return validation


# ----------------------------------------------------------------------------- output


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    fmt = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body)]


VERDICT_WORDS = {"held": "held", "imprecise": "IMPRECISE", "failed": "FAILED", "refused": "REFUSED", "error": "ERROR",
                 "skipped": "not run"}
TABLE_HEADER = ("strategy", "dtype", "property", "verdict", "examples", "worst figure / bound", "reproducing input")


def _table_rows(verdicts: Sequence[Verdict]) -> list[tuple[str, ...]]:
    def last(v: Verdict) -> str:
        if v.status == "refused" and v.detail:  # the kernel's own message says why
            return v.detail.splitlines()[0]
        return v.case or v.detail.splitlines()[0] if (v.case or v.detail) else ""

    return [(v.strategy, v.dtype, v.property, VERDICT_WORDS[v.status], examples_text(v), v.figure_text(), last(v))
            for v in verdicts]


def examples_text(v: Verdict) -> str:
    """"4", or "4 (+2 declined)" where the kernel declined inputs (NotImplementedError) the search then skipped."""
    return f"{v.examples}" + (f" (+{v.declined} declined)" if v.declined else "")


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    """The verdict table, plain text: one line per (strategy, dtype, property)."""
    return "\n".join(_aligned(TABLE_HEADER, _table_rows(verdicts)))


def _markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(escape(c) for c in row) + " |" for row in body)]


def environment() -> dict[str, Any]:
    """The environment variables that change the numbers: fla's (FLA_NUMERICS_ENV) and TRITON_INTERPRET."""
    return {name: os.environ.get(name) for name in (*FLA_NUMERICS_ENV, "TRITON_INTERPRET")}


def all_versions(kernel_spec: str) -> dict[str, str]:
    """attnlab.commands.report's versions, fla-core's when installed, and the kernel's package version when it has one."""
    from importlib.metadata import PackageNotFoundError, version

    found = report.versions()
    try:
        found["fla-core"] = version("fla-core")
    except PackageNotFoundError:
        pass
    module_name = kernel_spec.rpartition(":")[0]
    top = sys.modules.get(module_name.split(".")[0]) or sys.modules.get(Path(module_name).stem)
    if top is not None and getattr(top, "__version__", None):
        found[f"kernel package {top.__name__}"] = str(top.__version__)
    return found


def convention_dict(convention: Convention | None) -> dict[str, Any] | None:
    if convention is None:
        return None
    out: dict[str, Any] = {}
    for f in fields(Convention):
        value = getattr(convention, f.name)
        out[f.name] = (dict(value) if isinstance(value, Mapping) else list(value) if isinstance(value, tuple)
                       else str(value) if isinstance(value, torch.dtype) else value)
    out["describe"] = convention.describe()
    return out


def device_name(device: str) -> str:
    return report.device_description(device)


def verdict_counts(verdicts: list[Verdict]) -> str:
    """"2 failed, 1 imprecise, 1 error, 3 not run of 9 property runs": skipped runs are not counted as failures."""
    counts = {status: sum(x.status == status for x in verdicts)
              for status in ("failed", "refused", "imprecise", "error", "skipped")}
    parts = [f"{counts['failed']} failed"] + [f"{n} {label}" for label, n in (
        ("refused (the backward raised, or every input was declined)", counts["refused"]), ("imprecise", counts["imprecise"]),
        ("error", counts["error"]), ("not run", counts["skipped"])) if n]
    return f"{', '.join(parts)} of {len(verdicts)} property runs"


def verdict_words(v: Validation) -> str:
    """The run's verdict in a line: PASS or FAIL, and why."""
    if v.convention is None:
        return "FAIL: no convention matched"
    curve = sorted({r["T"] for r in v.curve if r["impl"] == v.kernel and report.row_verdict(r) == v.verdict})
    curve_note = (f"; the kernel's error-vs-length curve is {v.verdict} at T={','.join(map(str, curve))}"
                  if curve else "")
    if v.verdict == "held":
        return "PASS: every property held"
    imprecise = sum(x.status == "imprecise" for x in v.verdicts)
    if v.verdict == "imprecise" and not v.strict:
        return (f"PASS with {imprecise} imprecise of {len(v.verdicts)} property runs{curve_note} (above the accuracy "
                "bound, within the correctness bound: the right function, less accurately; --strict fails them)")
    if v.verdict == "imprecise":
        return f"FAIL (--strict): {imprecise} imprecise of {len(v.verdicts)} property runs{curve_note}"
    return f"FAIL: {verdict_counts(v.verdicts)}{curve_note}"


def bounds_table(v: Validation) -> dict[str, dict[str, float]]:
    """The accuracy and correctness bounds (excess) each dtype of the run was graded by."""
    from attnlab.metrics import user_bound, user_bounds
    from attnlab.registry import bounds_for

    with user_bound(v.bound):
        table = {d: user_bounds(bounds_for(formulation(v.formulation), d)) for d in v.dtypes}
    return {d: {"accuracy": b.accuracy, "correctness": b.correctness} for d, b in table.items()}


def bounds_words(v: Validation) -> str:
    source = "the user's accuracy bound (--bound)" if v.bound is not None else "attnlab.registry.BOUNDS"
    return ", ".join(f"{d} held <= {b['accuracy']:g}, failed > {b['correctness']:g}"
                     for d, b in bounds_table(v).items()) + f" ({source})"


def summary_markdown(v: Validation, data: dict[str, Any]) -> str:
    verdict = verdict_words(v)
    env = ", ".join(f"{k}={'unset' if val is None else val}" for k, val in data["env"].items())
    lines = [f"# attnlab validate: `{v.kernel}` ({v.formulation})", "", f"**{verdict}** (exit {v.exit_code}).", "",
             f"- Convention: {v.convention.describe() if v.convention else 'none matched'}",
             *([f"- Detection: {v.detection_text}"] if v.detection_text else []),
             *([f"- Note: {detection_caveat()}"] if v.detection is not None and v.convention is not None
               and v.verdict != "held" else []),
             f"- Device: {data['device']['name']}; dtypes {', '.join(v.dtypes)}; strategies {', '.join(v.strategies)}; "
             f"{v.examples} examples per property; sizes {v.sizes}; passes {', '.join(v.passes)}",
             f"- Bounds (excess, multiples of the floor): {bounds_words(v)}" + ("; --strict" if v.strict else ""),
             f"- Environment: {env}",
             "- Versions: " + ", ".join(f"{k} {val}" for k, val in data["versions"].items()),
             f"- Command: `{v.command}`" if v.command else "", f"- Time: {v.seconds:.0f} s", ""]
    if v.verdicts:
        lines += ["## Verdicts", "", *_markdown_table(TABLE_HEADER, _table_rows(v.verdicts)), ""]
    failed = [x for x in v.verdicts if x.status in ("failed", "refused", "error", "imprecise")]
    if failed:
        lines += ["## Failures" if any(x.status != "imprecise" for x in failed) else "## Imprecise", ""]
        for x in failed:
            lines += [f"### {x.property} ({x.strategy}, {x.dtype}): {x.status}", "", "```", x.message.strip(), "```",
                      ""]
            if x.found and x.found != x.case:
                lines += [f"Found first as `{x.found}` (after {x.first_failure} examples), minimized in "
                          f"{x.minimize_checks} checks.", ""]
            if verdict_key(x) in v.repro:
                lines += ["Reproduce:", "", "```python", v.repro[verdict_key(x)].rstrip(), "```", ""]
    if v.curve:
        lines += ["## Error vs length", "",
                  "Excess = rel_err / floor against the float64 oracle on the registry's default inputs "
                  f"({v.curve_settings['sizes']}, seed 0); 1.0 is a perfect kernel."
                  + (" `attnlab:<form>`: attnlab's own kernels; `fp32-recurrent` and `<dtype>-recurrent`: the naive "
                     "recurrences." if v.curve_settings.get("compare") else ""), "",
                  *report.summary_table(v.curve), "", f"![error vs length](curve/{v.formulation}.png)", ""]
        problems = report.failures(v.curve)
        if problems:
            lines += ["Curve points that failed:", "", *problems, ""]
    return "\n".join(line for line in lines if line is not None).rstrip() + "\n"


def write_outputs(v: Validation, out: Path) -> dict[str, Path]:
    """report.json, summary.md and (with a curve) curve/ with attnlab.commands.report's report.json, plot and index.md."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "what": "attnlab validate: the property suite and the error-vs-length curve on a third-party kernel",
        "kernel": v.kernel, "formulation": v.formulation, "exit_code": v.exit_code,
        "held": v.verdict == "held", "verdict": v.verdict, "verdict_text": verdict_words(v),
        "strict": v.strict, "bound": v.bound, "bounds": bounds_table(v), "passes": v.passes,
        "differentiable": v.differentiable,
        "convention": convention_dict(v.convention), "detection": v.detection, "detection_text": v.detection_text,
        "device": {"type": v.device, "name": device_name(v.device)},
        "dtypes": v.dtypes, "strategies": v.strategies, "examples": v.examples, "sizes": v.sizes,
        "env": environment(), "versions": all_versions(v.kernel), "command": v.command, "seconds": v.seconds,
        "verdicts": [{**asdict(x), "held": x.held, "figure_text": x.figure_text(), "pass": x.pass_name,
                      "gradient": x.gradient} for x in v.verdicts],
        "repro": v.repro,
        "curve": {**v.curve_settings, "rows": v.curve},
    }
    paths = {"report.json": out / "report.json", "summary.md": out / "summary.md"}
    paths["report.json"].write_text(json.dumps(data, indent=1, default=str) + "\n")
    paths["summary.md"].write_text(summary_markdown(v, data))
    if v.curve:
        curve_dir = out / "curve"
        curve_dir.mkdir(exist_ok=True)
        s = v.curve_settings
        settings = report.Settings(formulations=(v.formulation,), dtypes=tuple(v.dtypes), lengths=tuple(s["lengths"]),
                                   device=v.device, seed=s["seed"], sizes=report.Sizes(**s["sizes"]), mpmath_check_max_T=0)
        run = {"settings": {**asdict(settings), "command": v.command or "attnlab validate"}, "seed": s["seed"],
               "device": data["device"], "versions": data["versions"], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "seconds": v.seconds}
        report._write_report(curve_dir / "report.json", settings, run, v.curve, None)  # noqa: SLF001 - same package
        report.plot_error_vs_length(v.curve, v.formulation, curve_dir / f"{v.formulation}.png")
        paths["curve"] = report.write_index(curve_dir)
    return paths


# ----------------------------------------------------------------------------- command line


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be positive integers, comma-separated; got {text!r}")
    return sorted(set(values))


def _lengths_arg(text: str) -> list[int]:
    return [] if text.strip().lower() in ("none", "0", "") else _ints(text, "lengths")


def _dims_arg(text: str) -> list[int]:
    return _ints(text, "dims")


def _bound_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--bound must be a positive number (a multiple of the floor); got {text!r}")
    return value


def _strategy_arg(text: str) -> list[str]:
    if text == "both":
        return list(STRATEGIES)
    if text not in STRATEGIES:
        raise argparse.ArgumentTypeError(f"--strategy must be default, adversarial or both; got {text!r}")
    return [text]


def _passes_arg(text: str) -> list[str]:
    passes = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not passes or any(p not in ("forward", "backward") for p in passes):
        raise argparse.ArgumentTypeError(f"--passes must be forward, backward or forward,backward; got {text!r}")
    return passes


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``attnlab validate`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "validate", help="run the property suite on a third-party kernel: verdict table, report, exit 0/1",
        description=__doc__.split("\n\n", 2)[2].split("Exit status")[0].strip() if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 no property failed (imprecise ones pass unless --strict); 1 a property failed, or was "
               "imprecise under --strict, or its backward refused (or auto found no convention); 2 usage error "
               "(also --passes backward on a kernel that is not differentiable).")
    parser.add_argument("--formulation", metavar="NAME", help=f"what the kernel computes: one of {', '.join(names())}")
    parser.add_argument("--kernel", metavar="MODULE:FUNCTION",
                        help="the kernel: an importable module or a path to a .py file, then the function")
    parser.add_argument("--fla-op", metavar="OP",
                        help="an fla 0.6.0 kernel name: alone, validates fla.ops's OP in fla's convention; with "
                             "--kernel and --convention fla, says whose fla convention the kernel follows")
    parser.add_argument("--convention", choices=CONVENTIONS, default=None,
                        help="how the kernel is called (default attnlab; fla with --fla-op alone; peer: the "
                             "convention the registry declares for this MODULE:FUNCTION among the formulation's peers)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    parser.add_argument("--dtype", default=None,
                        help="comma-separated, from float16, bfloat16, float32 (default: float16,float32 on the CPU, "
                             "bfloat16,float16 on a GPU)")
    parser.add_argument("--strategy", type=_strategy_arg, default=list(STRATEGIES), metavar="default|adversarial|both",
                        help="input strategies (default both)")
    parser.add_argument("--profile", choices=tuple(PROFILE_EXAMPLES), default=None,
                        help="examples per property: " + ", ".join(f"{k} {n}" for k, n in PROFILE_EXAMPLES.items())
                             + " (default ci on the CPU, gpu on a GPU); also picks the shapes as the plugin does")
    parser.add_argument("--examples", type=int, default=None, help="examples per property, strategy and dtype (overrides --profile)")
    parser.add_argument("--properties", default=None, help="comma-separated property names (default: every applicable one)")
    parser.add_argument("--max-T", type=int, default=None, help="longest sequence drawn (default 72 on the CPU, 1024 on a GPU)")
    parser.add_argument("--dims", type=_dims_arg, default=None, metavar="LIST",
                        help="draw K and V only from these (e.g. 64,128: each new head dim recompiles a Triton kernel)")
    parser.add_argument("--max-H", type=int, default=None, help="most heads drawn")
    parser.add_argument("--max-B", type=int, default=None, help="largest batch drawn")
    parser.add_argument("--minimize", type=int, default=MINIMIZE_TRIES, metavar="N",
                        help=f"checks spent minimizing each failure (default {MINIMIZE_TRIES}; 0: report it as found)")
    parser.add_argument("--lengths", type=_lengths_arg, default=None, metavar="LIST|none",
                        help="lengths of the error-vs-length curve (default 16,32,64,128 on the CPU, 64,...,16384 on a "
                             "GPU; none: no curve)")
    parser.add_argument("--curve-shape", type=report.shape_arg, default=None, metavar="B,H,K,V",
                        help="shape of the curve's inputs (default 1,2,16,16 on the CPU, 1,4,64,64 on a GPU)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="put attnlab's own kernels (where they run on this device and dtype) and the naive "
                             "recurrences on the curve (default on)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="stop starting new searches after S seconds (those left are 'not run': exit 1)")
    parser.add_argument("--curve-first", action="store_true",
                        help="measure the curve before the property searches (so a --time-budget spent on the "
                             "searches still leaves the curve)")
    parser.add_argument("--out", type=Path, default=None, help="write report.json, summary.md and curve/ here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--verbose", action="store_true", help="print every property's report, held ones too")
    parser.add_argument("--strict", action="store_true",
                        help="an imprecise verdict (above the accuracy bound, within the correctness bound) fails the "
                             "run (exit 1); without it, it is reported and passes")
    parser.add_argument("--bound", type=_bound_arg, default=None, metavar="X",
                        help="accuracy bound (excess = rel_err / floor, a multiple of the floor) in place of the "
                             "registry's, for the run's one dtype (--dtype)")
    parser.add_argument("--passes", type=_passes_arg, default=None, metavar="forward,backward",
                        help="passes to judge: forward, backward or forward,backward (default: both when the kernel is "
                             "differentiable, else forward). backward on a kernel that is not differentiable is a "
                             "usage error (exit 2); a backward that raises is 'refused' on each gradient's row, "
                             "counted as failed (exit 1)")
    parser.set_defaults(func=command)
    return parser


def _usage(message: str) -> int:
    return usage_error("validate", message)


def command(args: argparse.Namespace) -> int:
    from attnlab.evaluate import parse_dtype
    from attnlab.properties.suite import KERNEL_PROPERTIES, sizes_for

    name, spec, convention = args.formulation, args.kernel, args.convention
    if spec is None and args.fla_op is not None:
        try:
            name, spec = fla_kernel(args.fla_op, name)
        except UsageError as error:
            return _usage(str(error))
        convention = convention or "fla"
    if spec is None:
        return _usage("--kernel MODULE:FUNCTION is required (or --fla-op OP for fla's own kernel)")
    if name is None:
        return _usage("--formulation NAME is required: which function the kernel computes "
                      f"(one of {', '.join(names())})")
    if name not in names():
        return _usage(f"unknown formulation {name!r}; expected one of {', '.join(names())}")
    convention = convention or "attnlab"
    if args.fla_op is not None and convention != "fla":
        return _usage("--fla-op with --kernel needs --convention fla")
    if args.device == "cuda" and not torch.cuda.is_available():
        return _usage("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dtype_names = [d.strip() for d in args.dtype.split(",") if d.strip()] if args.dtype else (
            ["bfloat16", "float16"] if device == "cuda" else ["float16", "float32"])
        dtypes = [parse_dtype(d) for d in dtype_names]
    except ValueError as error:
        return _usage(f"--dtype: {error}")
    if not dtypes:
        return _usage("--dtype: give at least one dtype")
    if args.bound is not None and len(dtypes) != 1:
        return _usage(f"--bound {args.bound:g} is a multiple of one dtype's floor: give exactly one --dtype "
                      f"(got {', '.join(dtype_names)})")
    only = [p.strip() for p in args.properties.split(",") if p.strip()] if args.properties else None
    from attnlab.properties.checks import BACKWARD_CHECKS

    known = [p.name for p in KERNEL_PROPERTIES] + list(BACKWARD_CHECKS)
    only_base = [p.split("[", 1)[0] for p in only] if only else None
    if only and any(p not in known for p in only_base):
        return _usage(f"--properties: unknown {', '.join(p for p, b in zip(only, only_base) if b not in known)}; expected some of {', '.join(known)}")
    profile = args.profile or ("gpu" if device == "cuda" else "ci")
    examples = args.examples if args.examples is not None else PROFILE_EXAMPLES[profile]
    if examples < 1:
        return _usage("--examples must be at least 1")
    sizes = sizes_for(device, profile)
    sizes = replace(sizes, **{k: v for k, v in (("max_T", args.max_T), ("max_H", args.max_H), ("max_B", args.max_B),
                                                 ("max_dim", max(args.dims) if args.dims else None)) if v is not None})
    if sizes.max_T < 2 or sizes.max_H < 1 or sizes.max_B < 1:
        return _usage("--max-T must be at least 2, --max-H and --max-B at least 1")
    lengths = args.lengths if args.lengths is not None else list(CURVE_DEFAULTS[device][0])
    command_line = "attnlab validate " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["validate"] else ""
    try:
        validation = validate(spec, name, convention=convention, fla_op=args.fla_op if args.kernel else None,
                              device=device, dtypes=dtypes, strategies=args.strategy, examples=examples, sizes=sizes,
                              dims=args.dims, only=only, lengths=lengths, curve_sizes=args.curve_shape,
                              compare=args.compare, minimize_tries=args.minimize, time_budget=args.time_budget,
                              progress=not args.no_progress, command=command_line, curve_first=args.curve_first,
                              strict=args.strict, bound=args.bound, passes=args.passes)
    except UsageError as error:
        return _usage(str(error))
    if validation.convention is not None:
        print()
        print(verdict_table(validation.verdicts))
        print(f"bounds (excess): {bounds_words(validation)}")
        for v in validation.verdicts:
            if v.status in ("failed", "refused", "error", "imprecise") or (args.verbose and v.message):
                print(f"\n--- {VERDICT_WORDS[v.status]}: {v.property} ({v.strategy}, {v.dtype})\n{v.message.strip()}")
                if v.found and v.found != v.case:
                    print(f"  found first: {v.found} (example {v.first_failure}); minimized in {v.minimize_checks} checks")
                if verdict_key(v) in validation.repro:
                    print(f"  reproduce: the standalone script between the cut lines (save it as a .py file, run it "
                          f"with python: it prints the figure and exits 1 while the failure reproduces)\n"
                          f"{REPRO_CUT}\n{validation.repro[verdict_key(v)].rstrip()}\n{REPRO_END}")
    if args.out is not None:
        paths = write_outputs(validation, args.out)
        print(f"\nreport: {', '.join(str(p) for p in paths.values())}")
    bad = [v for v in validation.verdicts if not v.held]
    if validation.convention is None:
        print("\nverdict: FAIL (no convention matched; nothing validated)")
    elif validation.verdict != "held":
        where = f" ({', '.join(sorted({v.property for v in bad}))})" if bad else ""
        print(f"\nverdict: {verdict_words(validation)}{where}; {validation.seconds:.0f} s")
        if validation.detection is not None:
            print(f"note: {detection_caveat()}")
    else:
        print(f"\nverdict: PASS: all {len(validation.verdicts)} property runs held; {validation.seconds:.0f} s")
    return validation.exit_code
