"""The default kernel property suite and its hypothesis driver.

``KERNEL_PROPERTIES`` lists every property a kernel target is held to, each
with the targets it applies to, the cases it draws and its check. The
pytest suites (test_kernel_properties.py) and ``attnlab selftest`` both run
them through :func:`search`, which builds one hypothesis test per
(property, target, dtype): it steers the search with ``hypothesis.target()``
on ``log(figure / bound)``, runs the kept regressions first, and raises the
check's AssertionError on the first input where the property fails.

Verdicts (attnlab.properties.checks): a *failed* result always ends the
search. An *imprecise* one (above the accuracy bound, within the
correctness bound) ends it only under ``strict``; otherwise the search goes
on looking for a failure, keeps the worst imprecise result, and warns
(:class:`ImpreciseWarning`) once at its end. ``strict`` defaults to
:data:`POLICY` (the pytest plugin's ``--attnlab-strict``).

A CUDA fault (checks.is_cuda_fault: an illegal memory access and the like) loses the process's CUDA context: every
later CUDA call fails, whatever its input. Shrinking it would fail every smaller case the same way and report the
smallest, which says nothing, and every later search in the process would fail the same way too. So the search
stops calling the kernel at the first fault and reports that case as drawn, and :func:`lost_context` keeps it: a
later search in the process fails at once, unrun, naming it (the pytest plugin ends a pytest-xdist worker instead,
so that a fresh one runs the rest).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import PurePath

import hypothesis
import torch
from hypothesis import example, given
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st

from attnlab.properties import checks, traits
from attnlab.properties.checks import DECLINED, FAILED, HELD, IMPRECISE, CheckResult
from attnlab.properties.regressions import REGRESSIONS
from attnlab.properties.strategies import (CPU_SIZES, CPU_THOROUGH_SIZES, GPU_SIZES, Case, Sizes, cases)
from attnlab.properties.targets import Target

__all__ = ["KernelProperty", "KERNEL_PROPERTIES", "Outcome", "Policy", "POLICY", "ImpreciseWarning", "search", "run",
           "sizes_for", "applicable", "PASSES", "backward_properties", "base_name", "LostContext", "lost_context",
           "portable_label"]

CaseStrategy = Callable[[Target, torch.dtype, Sizes], st.SearchStrategy[Case]]
Check = Callable[[Target, Case, torch.dtype, str], CheckResult]


@dataclass(frozen=True)
class KernelProperty:
    """A property of a kernel target: where it applies, what it draws, how it is checked."""

    name: str
    summary: str
    applies: Callable[[Target], bool]
    cases: CaseStrategy
    check: Check

    def fits(self, target: Target, case: Case) -> bool:
        """Whether a kept regression ``case`` is an input of this property for ``target``."""
        if self.name == "reduces_to_special_case":
            return case.name in {r.special for r in traits.reductions_of(target.formulation)}
        return case.name == target.formulation


def _always(target: Target) -> bool:
    return True


def _special_cases(target: Target, dtype: torch.dtype, sizes: Sizes) -> st.SearchStrategy[Case]:
    return st.one_of(*[cases(r.special, dtype, sizes, options=r.special_options)
                       for r in traits.reductions_of(target.formulation)])


KERNEL_PROPERTIES: tuple[KernelProperty, ...] = (
    KernelProperty(
        "matches_oracle", "o within the excess bound of the float64 oracle, finite where it is",
        _always, lambda t, d, s: cases(t.formulation, d, s), checks.check_matches_oracle),
    KernelProperty(
        "overflow", "past every exp overflow threshold of the dtype, still finite and within bound",
        lambda t: traits.exp_overflow_applies(t.formulation),
        lambda t, d, s: cases(t.formulation, d, s, overflow=True), checks.check_overflow),
    KernelProperty(
        "causality", "inputs after t never change outputs up to t (bitwise)",
        _always, lambda t, d, s: cases(t.formulation, d, s, with_cut=True, causal=True), checks.check_causality),
    KernelProperty(
        "chunk_size_invariance", "every accepted chunk size gives the same output within bound",
        lambda t: len(t.chunk_sizes) >= 2, lambda t, d, s: cases(t.formulation, d, s),
        checks.check_chunk_size_invariance),
    KernelProperty(
        "split_and_resume", "two calls through the returned state equal one call on the whole",
        lambda t: t.accepts_state, lambda t, d, s: cases(t.formulation, d, s, with_cut=True),
        checks.check_split_and_resume),
    KernelProperty(
        "convexity", "each output lies between the min and max of the values it averages",
        lambda t: traits.is_convex(t.formulation, {}), lambda t, d, s: cases(t.formulation, d, s, convex=True),
        checks.check_convexity),
    KernelProperty(
        "shift_invariance", "one constant added to every key changes nothing",
        lambda t: bool(traits.shift_invariant_args(t.formulation)),
        lambda t, d, s: cases(t.formulation, d, s, shifted=True), checks.check_shift_invariance),
    KernelProperty(
        "reduces_to_special_case", "on reducing inputs, matches the special formulation's oracle",
        lambda t: bool(traits.reductions_of(t.formulation)), _special_cases, checks.check_reduces_to_special_case),
)


PASSES = ("forward", "backward")
# The backward properties (checks.BACKWARD_CHECKS), one per (check, gradient): the check's name, what it says, the
# gradients it applies to (given the target and one gradient label) and the cases it draws.
BACKWARD_KINDS: tuple[tuple[str, str, Callable[[Target, str], bool], CaseStrategy], ...] = (
    ("backward_matches_oracle", "the gradient within the gradient bounds of float64 autograd through the oracle",
     lambda t, g: True, lambda t, d, s: cases(t.formulation, d, s)),
    ("backward_finite", "the gradient finite where the float64 gradient is",
     lambda t, g: True, lambda t, d, s: cases(t.formulation, d, s)),
    ("backward_query_identity", "<q, dq> = <o, do> where o is linear in q",
     lambda t, g: t.entry.linear_in_query_when is not None and g == "d" + t.entry.args_with_role("query")[0].name,
     lambda t, d, s: cases(t.formulation, d, s, options=t.entry.linear_in_query_when or ())),
    ("backward_shift_identity", "the sum over positions of dk is zero (shift invariance)",
     lambda t, g: checks.keys_shift_invariant(t.entry, g[1:]), lambda t, d, s: cases(t.formulation, d, s)),
    ("backward_causality", "with do zero from c on, every gradient at positions >= c exactly zero; before c, the "
     "prefix run's", lambda t, g: g != checks.STATE_GRADIENT,
     lambda t, d, s: cases(t.formulation, d, s, with_cut=True, causal=True)),
    ("backward_chunk_size_invariance", "every accepted chunk size gives the same gradient within bound",
     lambda t, g: len(t.chunk_sizes) >= 2 and g != checks.STATE_GRADIENT, lambda t, d, s: cases(t.formulation, d, s)),
    ("backward_split_and_resume", "gradients through a run split and resumed from its state equal the whole run's",
     lambda t, g: t.accepts_state and g != checks.STATE_GRADIENT,
     lambda t, d, s: cases(t.formulation, d, s, with_cut=True)),
)


def backward_properties(target: Target) -> list[KernelProperty]:
    """The backward properties of ``target`` (whether or not it is differentiable): one per (check, gradient),
    named ``check[gradient]`` (``backward_matches_oracle[dk]``)."""
    out = []
    for kind, summary, applies, strategy in BACKWARD_KINDS:
        for gradient in checks.gradient_names(target):
            if applies(target, gradient):
                out.append(KernelProperty(f"{kind}[{gradient}]", f"{gradient}: {summary}", lambda t: t.differentiable,
                                          strategy, partial(checks.BACKWARD_CHECKS[kind], gradient=gradient)))
    return out


def base_name(name: str) -> str:
    """``backward_matches_oracle`` of ``backward_matches_oracle[dq]``; a forward property's name unchanged."""
    return name.split("[", 1)[0]


def applicable(target: Target, passes: tuple[str, ...] | list[str] = ("forward",), *,
               assume_differentiable: bool = False) -> list[KernelProperty]:
    """The properties ``target`` is held to in ``passes``: the forward's that apply, and with "backward" the
    backward properties when the target is differentiable (Target.differentiable, which calls the kernel once;
    ``assume_differentiable`` lists them without that call, as a plan made before any kernel runs does)."""
    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        raise ValueError(f"passes must be among {', '.join(PASSES)}; got {', '.join(unknown)}")
    chosen = [p for p in KERNEL_PROPERTIES if p.applies(target)] if "forward" in passes else []
    if "backward" in passes and (assume_differentiable or target.differentiable):
        chosen += backward_properties(target)
    return chosen


def sizes_for(device: str, profile: str) -> Sizes:
    """The shapes drawn: small on the CPU (the interpreter is slow), larger under ``thorough``, real on a GPU."""
    if device == "cuda":
        return GPU_SIZES
    return CPU_THOROUGH_SIZES if profile == "thorough" else CPU_SIZES


class ImpreciseWarning(UserWarning):
    """A property came out imprecise (not held, not failed) and the search was not strict."""


@dataclass
class Policy:
    """How :func:`search` treats an imprecise result when its caller does not say (the plugin sets it)."""

    strict: bool = False


POLICY = Policy()


@dataclass(frozen=True)
class LostContext:
    """The CUDA fault that lost this process's CUDA context: the result it failed with, and the search it ended."""

    result: CheckResult
    search: str  # "PROPERTY on TARGET in DTYPE"

    def fault_message(self) -> str:
        return (f"CUDA FAULT in {self.search}: the kernel's launch lost this process's CUDA context\n"
                f"{self.result.message()}\n"
                "  the input is the first that faulted, as drawn: after a fault every CUDA call fails, so no smaller "
                "input could be told apart, and none was tried\n"
                "  every later CUDA call in this process fails: under pytest-xdist (-n) the worker ends before its "
                "next test, which is reported as crashed, and a fresh worker runs the rest; run it again with "
                "pytest --lf")

    def not_run_message(self) -> str:
        return (f"NOT RUN: this process's CUDA context was lost earlier, in {self.search}, on "
                f"{self.result.case!r}: every CUDA call here fails. Run it again in a fresh process (under pytest: "
                "pytest --lf, or -n N, whose workers are replaced after a fault).")


_LOST: list[LostContext] = []  # the process's CUDA fault, once it happened


def lost_context() -> LostContext | None:
    """The CUDA fault that lost this process's CUDA context, if a search met one."""
    return _LOST[0] if _LOST else None


@dataclass
class Outcome:
    """What one search found: examples run, the first result that ended the search (1-based), the worst result,
    the worst imprecise result the search went on past, the first result that did not hold, and harness errors.

    ``failure`` is the first failed result, or under ``strict`` the first imprecise one; ``verdict`` is
    "failed", "error" (the harness broke), "imprecise" or "held".
    """

    property: str
    target: str
    dtype: torch.dtype
    examples: int = 0
    first_failure: int | None = None
    worst: CheckResult | None = None
    failure: CheckResult | None = None
    errors: list[str] = field(default_factory=list)
    imprecise: CheckResult | None = None
    first_not_held: CheckResult | None = None
    budget_spent: bool = False  # the search stopped drawing at its deadline, before max_examples
    cuda_fault: CheckResult | None = None  # the failure that lost the CUDA context (it is also ``failure``)
    declined: int = 0  # inputs the kernel declined (NotImplementedError): skipped, not counted in examples
    first_declined: CheckResult | None = None

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return self.failure.verdict
        if self.errors:
            return "error"
        return IMPRECISE if self.imprecise is not None else HELD

    @property
    def held(self) -> bool:
        return self.verdict == HELD

    @property
    def result(self) -> CheckResult | None:
        """The result the verdict rests on: the failure, else the worst imprecise result, else the worst one."""
        return self.failure or self.imprecise or self.worst


# What the check returns in place of a CUDA fault, and after it: no kernel runs on a lost context.
_NOT_RUN = "not run: the CUDA context was lost"


def _stopping_at_a_cuda_fault(check: Check, record: Outcome) -> Check:
    """``check`` that keeps the first CUDA fault in ``record.cuda_fault`` and, for it and every later case, returns a
    held result without calling the kernel: hypothesis, which shrinks what fails, then never sees the fault."""

    def checked(target: Target, case: Case, dtype: torch.dtype, device: str) -> CheckResult:
        if record.cuda_fault is None:
            result = check(target, case, dtype, device)
            if not checks.is_cuda_fault(result):
                return result
            record.cuda_fault, record.first_failure = result, record.examples + 1
        return CheckResult(record.property, HELD, 0.0, 1.0, _NOT_RUN, target.label, case, dtype, device)

    return checked


def search(prop: KernelProperty, target: Target, dtype: torch.dtype, device: str, sizes: Sizes,
           settings: hypothesis.settings | None = None, outcome: Outcome | None = None, *,
           fit: Callable[[Case], Case] | None = None, regressions: bool = True,
           strict: bool | None = None, warn: bool = True, replay: Sequence[Case] = (),
           deadline: float | None = None) -> Callable[[], None]:
    """A hypothesis test that checks ``prop`` on ``target``: call it; it raises AssertionError on a failure
    (and on an imprecise result under ``strict``, default :data:`POLICY`.strict).

    ``settings`` default to the loaded hypothesis profile; ``outcome``, if
    given, is filled in as the search runs. ``fit``, if given, edits every
    case (drawn or kept regression) before it is checked (``attnlab
    validate``: a kernel's fixed scale, its head dims); ``regressions=False``
    leaves the kept regressions out. ``replay`` cases run first, before the
    regressions and the drawn cases (``attnlab campaign`` replays the
    counterexamples it stored). Past ``deadline`` (``time.monotonic()``), once
    the replayed cases and one more have been tried (a declined case counts), the search rejects every further
    draw, so that it ends within about one check of its time
    (``outcome.budget_spent``). A case the kernel declines (it raises NotImplementedError:
    :data:`checks.DECLINED`) is skipped and counted in ``outcome.declined``; when it declines every case, the
    search fails with the kernel's message. Not strict, an imprecise result is kept
    in ``outcome.imprecise`` and, with ``warn``, an :class:`ImpreciseWarning`
    names the worst one when the search ends without a failure.
    """
    record = outcome if outcome is not None else Outcome(prop.name, target.label, dtype)
    strict = POLICY.strict if strict is None else strict
    where = f"{prop.name} on {target.label} in {str(dtype).removeprefix('torch.')}"

    prop = replace(prop, check=_stopping_at_a_cuda_fault(prop.check, record))

    def check_one(case: Case) -> None:
        if deadline is not None and record.examples + record.declined > len(replay) and time.monotonic() > deadline:
            record.budget_spent = True
            hypothesis.assume(False)
        if fit is not None:
            case = fit(case)
        result = prop.check(target, case, dtype, device)
        if result.measure == DECLINED:
            record.declined += 1
            record.first_declined = record.first_declined or result
            hypothesis.assume(False)  # not this kernel's input: draw another
        record.examples += 1
        hypothesis.target(result.score, label=f"log({prop.name} figure / bound)")
        if record.worst is None or result.score > record.worst.score:
            record.worst = result
        if not result.held and record.first_not_held is None:
            record.first_not_held = result
        ends = result.verdict == FAILED or (strict and result.verdict == IMPRECISE)
        if ends and record.failure is None:
            record.failure, record.first_failure = result, record.examples
        worse = record.imprecise is None or result.score > record.imprecise.score
        if result.verdict == IMPRECISE and not strict and worse:
            record.imprecise = result
        if ends:
            raise AssertionError(result.message())

    test = given(case=prop.cases(target, dtype, sizes))(check_one)
    kept = [*(REGRESSIONS.get(prop.name, ()) if regressions else ()), *reversed(replay)]
    for regression in kept:  # the last decorator's example runs first
        if prop.fits(target, regression):
            test = example(case=regression)(test)
    if settings is not None:
        test = settings(test)
    # One hypothesis database key per (property, target, dtype), as pytest's parametrize would give; the backward
    # properties of one check share it across gradients, so that they draw the same cases and share one backward
    # pass per case (checks.gradient_run's cache).
    key = f"{base_name(prop.name)}|{portable_label(target.label)}|{dtype}".encode()
    test._hypothesis_internal_add_digest = key  # type: ignore[attr-defined]
    # Derandomized (the ci profile), the draws come from that key alone: hypothesis would seed them from check_one's
    # source too, so that any edit of it changed every draw of the suite.
    if (settings if settings is not None else hypothesis.settings.default).derandomize:
        test = hypothesis.seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))(test)

    def run_search() -> None:
        lost = lost_context()
        if lost is not None and lost.result.device == device:
            raise AssertionError(lost.not_run_message())
        try:
            test()
        except Unsatisfiable:
            if record.budget_spent and record.examples:
                return  # the kept cases spent the budget: every draw after them was rejected at the deadline
            if record.first_declined is None:
                raise
            # The kernel declined every input drawn: a failure of its own, carrying the kernel's message.
            record.failure, record.first_failure = record.first_declined, 1
            raise AssertionError(f"{target.label} declined every input drawn ({record.declined}): "
                                 f"{record.first_declined.message()}") from None
        if record.cuda_fault is not None:
            record.failure = record.worst = record.cuda_fault
            _LOST.append(LostContext(record.cuda_fault, where))
            raise AssertionError(_LOST[-1].fault_message())
        if warn and record.imprecise is not None and record.failure is None:
            warnings.warn(ImpreciseWarning(
                f"{record.imprecise.message()}\n  (passes: imprecise is not failed; --attnlab-strict fails it)"),
                stacklevel=2)

    return run_search


def portable_label(label: str) -> str:
    """``label`` with the folders of a ``PATH:FUNCTION`` kernel dropped (``/tmp/a/mykernels.py:f`` is
    ``mykernels.py:f``): the key that seeds a derandomized search, so that its draws do not depend on the folder a
    kernel's file lies in (one checkout and another, one pytest tmp folder and the next)."""
    module, colon, function = label.rpartition(":")
    if "/" not in module:
        return label
    return f"{PurePath(module).name}{colon}{function}"


def run(prop: KernelProperty, target: Target, dtype: torch.dtype, device: str, sizes: Sizes,
        settings: hypothesis.settings | None = None, *, fit: Callable[[Case], Case] | None = None,
        regressions: bool = True, strict: bool = False, replay: Sequence[Case] = (),
        deadline: float | None = None) -> Outcome:
    """Run one search to its end and return its Outcome instead of raising (or warning). Not ``strict`` (the
    default here), the search goes on past imprecise results looking for a failure."""
    outcome = Outcome(prop.name, target.label, dtype)
    try:
        search(prop, target, dtype, device, sizes, settings, outcome, fit=fit, regressions=regressions, strict=strict,
               warn=False, replay=replay, deadline=deadline)()
    except AssertionError as error:
        if outcome.failure is None:  # an assertion of the harness, not a failed property
            outcome.errors.append(f"AssertionError: {error}")
    except Exception as error:  # noqa: BLE001 - reported, never swallowed silently
        outcome.errors.append(f"{type(error).__name__}: {error}")
    return outcome
