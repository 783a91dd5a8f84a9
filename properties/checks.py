"""Property checks: plain functions, usable outside pytest, each returning a :class:`CheckResult`.

A result carries its verdict, the measured figure, the bound it was held to,
what the figure measures, and the reproducing input (a
:class:`~attnlab.properties.strategies.Case`). ``result.assert_held()`` raises
an AssertionError whose message a kernel author can act on.

Verdicts: ``held``, ``imprecise`` or ``failed``. The checks that measure an
error against the floor (matches_oracle, overflow, shift_invariance,
reduces_to_special_case, chunk_size_invariance, split_and_resume) grade it
by two bounds, both read from the registry (``attnlab.registry.bounds_for``,
the one table; its ``why`` says how each was measured): within the
*accuracy* bound the property held; above it, up to the *correctness* bound,
the kernel computes the right function less accurately than one rounding
allows (imprecise); above the correctness bound, or with a NaN or inf where
the oracle is finite, or when the implementation raised, it computes
something else (failed). Exact properties (causality, bitwise; convexity;
the float64 identities) are held or failed.

- kernel against the float64 oracle: ``excess = rel_err / max(floor_round,
  floor_cond)`` (attnlab.metrics) against ``accuracy`` / ``correctness``;
  :func:`user_bound` replaces the accuracy bound (``attnlab validate
  --bound``, the plugin's ``--attnlab-bound``);
- two kernel outputs that should agree (chunk sizes): their difference,
  over the same floor, against twice both bounds (each output may be off by
  one bound, in opposite directions);
- final states: the registry's ``state`` bound relative, or the accuracy
  bound times the state's own conditioning floor where that is larger (keys
  shifted far); failed above that times ``correctness / accuracy``;
- identities of exact arithmetic in float64: relative 1e-12;
- causality: bitwise.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.metrics import (FAILED, HELD, IMPRECISE, VERDICTS, Measurement, conditioning_floor, grade, measure,
                             rel_err, rounding_floor, set_user_bound, unit_roundoff, user_bound, user_bounds, verdict,
                             worst_verdict)
from attnlab.oracle import oracle
from attnlab.oracles._backend import Float64
from attnlab.oracles._chunks import pairwise_decay, unit_lower_inverse
from attnlab.properties import traits
from attnlab.properties.strategies import Case, round_to
from attnlab.properties.targets import Target
from attnlab.registry import bounds_for, formulation
from attnlab.spec import Bounds

__all__ = [
    "CheckResult", "HELD", "IMPRECISE", "FAILED", "VERDICTS", "IDENTITY_TOLERANCE", "bounds", "user_bound",
    "set_user_bound", "grade", "worst_verdict",
    "check_matches_oracle", "check_overflow", "check_causality", "check_chunk_size_invariance",
    "check_split_and_resume", "check_convexity", "check_shift_invariance", "check_reduces_to_special_case",
    "check_forms_agree", "check_oracle_reduction", "check_ut_inverse_bounded", "check_decay_products_contract",
]

IDENTITY_TOLERANCE = 1e-12
# The float64 reference: the chunkwise oracle (certified by mpmath in tests/test_oracles.py).
ORACLE_CHUNK_SIZE = 64
# The bound on |(I + L)^-1_ij| / (beta_i |k_i| |k_j|), with float64 slack.
UT_ENTRY_BOUND = 1.0 + 1e-9
CONTRACTION_BOUND = 1.0 + 1e-12
RAISED = "the implementation raised"


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "float64"


def bounds(name: str, dtype: torch.dtype) -> Bounds:
    """The bounds ``name``'s outputs in ``dtype`` are graded by: the registry's (attnlab.registry.bounds_for),
    with the accuracy bound replaced where :func:`user_bound` is in force (attnlab.metrics.user_bounds)."""
    return user_bounds(bounds_for(formulation(name), _dtype_name(dtype)))


def exact(ok: bool) -> str:
    """The verdict of an exact property: held or failed, nothing between."""
    return HELD if ok else FAILED


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one property on one input.

    ``verdict`` is held, imprecise or failed (module docstring); ``figure`` is
    what was measured (``measure`` says what it is), ``bound`` the largest
    value for which the property held and, for the graded properties,
    ``correctness`` the largest that is not failed (None for exact
    properties). A non-finite figure, or an implementation that raised, is
    failed. ``held`` is ``verdict == "held"``.
    """

    property: str
    verdict: str
    figure: float
    bound: float
    measure: str
    subject: str
    case: Case | None
    dtype: torch.dtype | None = None
    device: str = "cpu"
    detail: str = ""
    correctness: float | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; got {self.verdict!r}")

    @property
    def held(self) -> bool:
        return self.verdict == HELD

    @property
    def failed(self) -> bool:
        return self.verdict == FAILED

    @property
    def score(self) -> float:
        """``log(figure / bound)``, finite and clamped to [-60, 60]: what hypothesis.target() climbs."""
        if math.isnan(self.figure):
            return 60.0
        if self.figure <= 0:
            return -60.0
        ratio = self.figure / self.bound if self.bound > 0 else math.inf
        return max(-60.0, min(60.0, math.log(ratio))) if ratio < math.inf else 60.0

    def bound_text(self) -> str:
        """``2`` for an exact property; ``2 (held), 32 (failed above)`` for a graded one."""
        if self.correctness is None:
            return f"{self.bound:.4g}"
        return f"{self.bound:.4g} (held), {self.correctness:.4g} (failed above)"

    def message(self) -> str:
        verdict = {HELD: "held", IMPRECISE: "IMPRECISE", FAILED: "FAILED"}[self.verdict]
        figure = (f"  figure: {self.measure} = {self.figure:.4g}    bound: {self.bound_text()}"
                  if self.measure != RAISED else f"  figure: none, {RAISED}")
        lines = [f"property {self.property} {verdict} for {self.subject} in {_dtype_name(self.dtype)} on {self.device}",
                 figure]
        if self.verdict == IMPRECISE:
            lines.append("  imprecise: above the accuracy bound, within the correctness bound: the right function, "
                         "computed less accurately than the bound allows")
        if self.detail:
            lines.append(f"  detail: {self.detail}")
        if self.case is not None:
            dtype = f"torch.{_dtype_name(self.dtype)}"
            lines += [
                f"  input: {self.case!r}",
                "  reproduce: from attnlab.properties.strategies import Case; "
                f"x = {self.case!r}.call({dtype}, {self.device!r}); o = kernel(**x)",
                f"  keep it as a regression: add {self.case!r} to REGRESSIONS[{self.property!r}] "
                "in attnlab/properties/regressions.py",
            ]
        return "\n".join(lines)

    def assert_held(self) -> None:
        """Raise unless the property held (imprecise counts as not held: the strict reading)."""
        if not self.held:
            raise AssertionError(self.message())

    def assert_not_failed(self) -> None:
        """Raise only when the verdict is failed (an imprecise result passes)."""
        if self.failed:
            raise AssertionError(self.message())


# ----------------------------------------------------------------------------- helpers


def _reference(name: str) -> Callable[..., Any]:
    return oracle(name, "chunkwise", "float64", chunk_size=ORACLE_CHUNK_SIZE)


def _within_ranges(name: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    """``reference`` with every tensor clamped to its registry range first.

    conditioning_floor perturbs inputs by one fp32 unit roundoff, which
    pushes a beta of exactly 2 past the valid [0, 2]; clamping keeps the
    perturbation inside the formulation's domain.
    """
    f = formulation(name)

    def clamped(**x: Any) -> Any:
        for arg in f.args:
            if isinstance(x.get(arg.name), torch.Tensor) and (arg.low is not None or arg.high is not None):
                x[arg.name] = x[arg.name].clamp(arg.low, arg.high)
        return reference(**x)

    return clamped


def _conditioning_floor(name: str, reference: Callable[..., Any], x: dict[str, Any]) -> float:
    return conditioning_floor(_within_ranges(name, reference), x)


def _raised(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, error: BaseException) -> CheckResult:
    where = traceback.extract_tb(error.__traceback__)[-1]
    return CheckResult(prop, FAILED, math.inf, 0.0, RAISED, target.label, case, dtype, device,
                       f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})")


def _contract_problem(o: Any, ref: torch.Tensor, dtype: torch.dtype) -> str:
    if not isinstance(o, torch.Tensor):
        return f"returned {type(o).__name__}, expected the output tensor o"
    if tuple(o.shape) != tuple(ref.shape):
        return f"returned o of shape {tuple(o.shape)}, expected {tuple(ref.shape)}"
    if o.dtype != dtype:
        return f"returned o in {_dtype_name(o.dtype)}, expected the input dtype {_dtype_name(dtype)}"
    return ""


def _measurement_detail(m: Measurement, o: torch.Tensor) -> str:
    return (f"rel_err {m.rel_err:.3e}, max_err {m.max_err:.3e}, floor_round {m.floor_round:.3e}, "
            f"floor_cond {m.floor_cond:.3e} (computed only when needed), non-finite entries {m.nonfinite} of {o.numel()}")


def max_ulps(o: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest |o - ref| in units in the last place of ``dtype`` at the reference entry."""
    ref = ref.detach().to(torch.float64).cpu()
    diff = (o.detach().to(torch.float64).cpu() - ref).abs()
    finfo = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(ref.abs().clamp(min=finfo.tiny)))
    ulp = torch.exp2(exponent - (finfo.nmant if hasattr(finfo, "nmant") else -math.log2(finfo.eps)))
    return float((diff / ulp).max()) if diff.numel() else 0.0


def _judge(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, o: Any, ref: torch.Tensor,
           floor_cond: Callable[[], float], note: str = "") -> CheckResult:
    """The excess of ``o`` over the floors of ``ref``, graded by the bounds of the target's formulation.

    ``floor_cond`` is evaluated (three more oracle calls) only when the
    rounding floor alone does not let ``o`` hold: it can only raise the floor.
    Non-finite entries where the oracle is finite, or a wrong output (type,
    shape, dtype), are failed.
    """
    b = bounds(target.formulation, dtype)
    bound, correctness = b.accuracy, b.correctness
    problem = _contract_problem(o, ref, dtype)
    if problem:
        return CheckResult(prop, FAILED, math.inf, bound, "excess = rel_err / floor", target.label, case, dtype,
                           device, problem, correctness)
    m = measure(o, ref, dtype)
    if m.nonfinite == 0 and not m.excess <= bound:
        m = measure(o, ref, dtype, floor_cond())
    graded = verdict(m, bound, correctness)
    held = graded == HELD
    detail = _measurement_detail(m, o) + (f"; {note}" if note else "")
    if m.floor_round == 0 and m.nonfinite == 0 and not held:
        detail += f"; the exact output is representable in {str(dtype).replace('torch.', '')}: off by up to {max_ulps(o, ref, dtype):.3g} ulps"
    if m.nonfinite:
        detail = "NaN or inf where the float64 oracle is finite; " + detail
    return CheckResult(prop, graded, m.excess, bound, "excess = rel_err / floor", target.label, case, dtype, device,
                       detail, correctness)


def split_time(name: str, x: dict[str, Any], cut: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inputs of positions ``[0, cut)`` and ``[cut, T)`` (arguments without time are shared)."""
    f = formulation(name)
    head, tail = {}, {}
    for key, value in x.items():
        axes = traits.time_axes(f.arg(key)) if key in f.arg_names and isinstance(value, torch.Tensor) else ()
        if not axes:
            head[key] = tail[key] = value
            continue
        T = value.shape[axes[0]]
        h, t = value, value
        for axis in axes:
            h, t = h.narrow(axis, 0, cut), t.narrow(axis, cut, T - cut)
        head[key], tail[key] = h.contiguous(), t.contiguous()
    return head, tail


def comparable_state(name: str, state: Any) -> tuple[torch.Tensor, ...]:
    """The parts of a returned state (tensor or tuple, any dtype or device) as float64 CPU tensors."""
    spec = formulation(name).state
    assert spec is not None
    return tuple(None if p is None else p.detach().to(torch.float64).cpu() for p in spec.split(state))


def _same_scale(name: str, state: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both states' plain parts, the first rescaled to the reference's log-scale.

    A state with a shared log-scale ``p`` (RWKV-4's ``(a, b, p)``, numerator
    ``e^p a``) is unique only up to it; ``e^p a`` itself overflows float64
    for p > 709, so ``a e^(p - p_ref)`` is compared with ``a_ref`` instead.
    """
    spec = formulation(name).state
    assert spec is not None
    logs = [i for i in range(len(spec.parts)) if spec.is_log_scale(i)]
    if not logs:
        return list(state), list(ref)
    factor = torch.exp(state[logs[0]] - ref[logs[0]])
    plain = [i for i in range(len(spec.parts)) if i not in logs]
    return [state[i] * factor for i in plain], [ref[i] for i in plain]


def _difference_over(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """|a - b| / |ref|: 0 when a equals b, also where the reference is exactly 0 (beta = 0 makes every
    delta-rule output 0), inf for a difference from a zero reference, NaN when either holds a NaN."""
    gap = (a.double() - b.double()).norm().item()
    scale = ref.double().norm().item()
    return 0.0 if gap == 0 else gap / scale if scale > 0 else math.inf


def _ratio(error: float, floor: float) -> float:
    """``error / floor``; where the floor is 0 (an exactly representable answer), 0 for no error, else inf."""
    return error / floor if floor > 0 else (0.0 if error == 0 else math.inf)


def _bitwise(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(ints)


def _state_reference(name: str) -> Callable[..., Any]:
    reference = _reference(name)

    def final_state(**x: Any) -> tuple[torch.Tensor, ...]:
        return reference(**x, return_state=True)[1]

    return final_state


# ----------------------------------------------------------------------------- kernel properties


def check_matches_oracle(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                         *, prop: str = "matches_oracle", note: str = "") -> CheckResult:
    """The target's ``o`` against the float64 oracle on the same rounded inputs: finite, excess within bound."""
    x = case.call(dtype, device)
    reference = _reference(case.name)
    ref = reference(**x)
    try:
        o = target(**x)
    except Exception as error:  # noqa: BLE001 - any failure of the implementation is a finding
        return _raised(prop, target, case, dtype, device, error)
    return _judge(prop, target, case, dtype, device, o, ref, lambda: _conditioning_floor(case.name, reference, x), note)


def overflow_note(case: Case, dtype: torch.dtype) -> str:
    """Which exponential of a naive implementation the case pushes past the dtype's range."""
    threshold = traits.EXP_OVERFLOW[dtype]
    name = _dtype_name(dtype)
    notes = []
    if case.key_shift:
        notes.append(f"keys shifted by {case.key_shift:+.4g}: a naive exp(k) in {name} overflows above {threshold} "
                     "(or underflows to 0 for a shift far below)")
    if case.logit_max is not None:
        notes.append(f"largest |scale q.k| = {case.logit_max:.4g}: a naive exp(logit) in {name} overflows above {threshold}")
    if case.gate_low is not None and case.gate_low < 0:
        notes.append(f"log gates down to {case.gate_low:.4g} per step: exp(-cumulative gate) overflows {name} "
                     f"once a chunk's decay passes {threshold}")
    return "; ".join(notes)


def check_overflow(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu") -> CheckResult:
    """Past every exp overflow threshold of the dtype, the target stays finite and within bound of the oracle."""
    return check_matches_oracle(target, case, dtype, device, prop="overflow", note=overflow_note(case, dtype))


def check_causality(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu") -> CheckResult:
    """Replacing every input at positions >= cut leaves the outputs at positions < cut bitwise unchanged."""
    assert case.cut is not None, "causality needs a case with a cut"
    f, cut = formulation(case.name), case.cut
    x = case.call(dtype, device)
    other = case.with_(seed=case.seed + 1).call(dtype, device)
    perturbed = dict(x)
    for arg in f.args:
        axes = traits.time_axes(arg)
        if not axes or arg.name not in x:
            continue
        future = torch.zeros(x[arg.name].shape, dtype=torch.bool, device=x[arg.name].device)
        for axis in axes:
            index = torch.arange(case.T, device=future.device) >= cut
            future |= index.reshape([-1 if a == axis else 1 for a in range(future.dim())]).expand_as(future)
        perturbed[arg.name] = torch.where(future, other[arg.name], x[arg.name])
    try:
        before, after = target(**x), target(**perturbed)
    except Exception as error:  # noqa: BLE001
        return _raised("causality", target, case, dtype, device, error)
    changed = _bitwise(before.narrow(1, 0, cut)) != _bitwise(after.narrow(1, 0, cut))
    count = int(changed.sum())
    detail = f"perturbed every input at positions {cut}..{case.T - 1}; compared outputs at positions 0..{cut - 1}"
    if count:
        positions = changed.reshape(changed.shape[0], cut, -1).any(dim=-1).any(dim=0).nonzero().flatten().tolist()
        difference = (before.narrow(1, 0, cut).double() - after.narrow(1, 0, cut).double()).abs().max().item()
        detail += f"; changed positions {positions[:8]}{'...' if len(positions) > 8 else ''}, max |change| {difference:.3e}"
    return CheckResult("causality", exact(count == 0), float(count), 0.0, "output entries before the cut that changed",
                       target.label, case, dtype, device, detail)


def check_chunk_size_invariance(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu") -> CheckResult:
    """Every chunk size the target accepts gives the same output, to within twice the accuracy bound (failed
    beyond twice the correctness bound)."""
    x = case.call(dtype, device)
    reference = _reference(case.name)
    ref = reference(**x)
    b = bounds(target.formulation, dtype)
    bound, correctness = 2 * b.accuracy, 2 * b.correctness
    try:
        outputs = {c: target(chunk_size=c, **x) for c in target.chunk_sizes}
    except Exception as error:  # noqa: BLE001
        return _raised("chunk_size_invariance", target, case, dtype, device, error)
    first, *others = target.chunk_sizes
    differences = {c: _difference_over(outputs[c], outputs[first], ref) for c in others}
    worst = max(differences, key=lambda c: math.inf if math.isnan(differences[c]) else differences[c])
    difference = differences[worst] if not math.isnan(differences[worst]) else math.inf
    floor = rounding_floor(ref, dtype)
    if not _ratio(difference, floor) <= bound:
        floor = max(floor, _conditioning_floor(case.name, reference, x))
    figure = _ratio(difference, floor)
    detail = f"chunk sizes {first} and {worst} differ by {difference:.3e} relative to |ref| (floor {floor:.3e})"
    return CheckResult("chunk_size_invariance", grade(figure, bound, correctness), figure, bound,
                       "|o_c1 - o_c2| / |ref| / floor", target.label, case, dtype, device, detail, correctness)


def check_split_and_resume(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu") -> CheckResult:
    """Running positions [0, cut), then [cut, T) from the returned state, equals the oracle on the whole sequence.

    Both the concatenated output (excess bounds) and the final state (state
    bound) are checked; the result is the worse of the two.
    """
    assert case.cut is not None, "split_and_resume needs a case with a cut"
    x = case.call(dtype, device)
    head, tail = split_time(case.name, x, case.cut)
    reference = _reference(case.name)
    ref, ref_state = reference(**x, return_state=True)
    try:
        o_head, state = target(**head, return_state=True)
        o_tail, final = target(**tail, initial_state=state, return_state=True)
    except Exception as error:  # noqa: BLE001
        return _raised("split_and_resume", target, case, dtype, device, error)
    note = f"split at {case.cut} of {case.T}"
    spec = formulation(case.name).state
    missing = [n for n, p in zip(spec.names, spec.split(state)) if p is None] if isinstance(o_head, torch.Tensor) else []
    if missing:
        # The kernel's state omits parts: the run can be resumed only if the tail's output does not depend on them.
        _, ref_head_state = reference(**head, return_state=True)
        parts = spec.split(ref_head_state)
        blank = spec.join(tuple(torch.full_like(p, e) if n in missing else p
                                for n, p, e in zip(spec.names, parts, spec.empty)))
        needed = reference(**tail, initial_state=ref_head_state)
        without = reference(**tail, initial_state=blank)
        if not torch.allclose(needed, without, rtol=1e-12, atol=0.0, equal_nan=True):
            words = " and ".join(spec.describe(n) for n in missing)
            options = ", ".join(f"{k}={v}" for k, v in dict(case.options).items()) if case.options else "these options"
            return CheckResult("split_and_resume", FAILED, math.inf, bounds(target.formulation, dtype).accuracy,
                               "state parts carried",
                               target.label, case, dtype, device,
                               f"the kernel's state omits {words}, so a run with {options} cannot be split and resumed "
                               f"(the output after the split depends on it); {note}")
    if not all(isinstance(o, torch.Tensor) for o in (o_head, o_tail)):
        return CheckResult("split_and_resume", FAILED, math.inf, bounds(target.formulation, dtype).accuracy,
                           "excess = rel_err / floor",
                           target.label, case, dtype, device, "did not return (o, state) with return_state=True")
    result = _judge("split_and_resume", target, case, dtype, device, torch.cat([o_head, o_tail], dim=1), ref,
                    lambda: _conditioning_floor(case.name, reference, x), note)
    if result.failed:
        return result
    mine_parts, ref_parts = comparable_state(case.name, final), comparable_state(case.name, ref_state)
    if any(p is None for p in mine_parts):  # compare the parts the kernel carries
        kept = [i for i, p in enumerate(mine_parts) if p is not None]
        mine_parts, ref_parts = tuple(mine_parts[i] for i in kept), tuple(ref_parts[i] for i in kept)
        note += f"; final state compared on {', '.join(spec.names[i] for i in kept)} (the parts the kernel carries)"
    mine, theirs = _same_scale(case.name, mine_parts, ref_parts)
    error = rel_err(mine, theirs)
    b = bounds(target.formulation, dtype)
    state_floor = _conditioning_floor(case.name, _state_reference(case.name), x) if error > b.state else 0.0
    bound = max(b.state, b.accuracy * state_floor)
    correctness = bound * b.correctness / b.accuracy  # the output's ratio of the two bounds
    state = CheckResult("split_and_resume", grade(error, bound, correctness), error, bound, "final state rel_err",
                        target.label, case, dtype, device,
                        f"{note}; output excess {result.figure:.3g} ({result.verdict}); state conditioning floor "
                        f"{state_floor:.3e}", correctness)
    return result if VERDICTS.index(result.verdict) > VERDICTS.index(state.verdict) else state


def _running_range(v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not causal:
        return v.amin(dim=1, keepdim=True).expand_as(v), v.amax(dim=1, keepdim=True).expand_as(v)
    return torch.cummin(v, dim=1).values, torch.cummax(v, dim=1).values


def check_convexity(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu") -> CheckResult:
    """Each output lies between the smallest and largest value it averages (per channel).

    Slack: one rounding of the output plus T fp32 roundings of the
    accumulation, times max |v|; K more where the output is read through a
    state by a query (linear attention: numerator and denominator are separate
    K-term dots whose roundings differ; at T=1, K=7 an fp32 kernel lands 3
    roundings outside).
    """
    x = case.call(dtype, device)
    try:
        o = target(**x)
    except Exception as error:  # noqa: BLE001
        return _raised("convexity", target, case, dtype, device, error)
    v = x["v"].double().cpu()
    low, high = _running_range(v, dict(case.options).get("causal", True))
    o64 = o.double().cpu()
    violation = torch.maximum(low - o64, o64 - high).clamp_min(0)
    violation = torch.where(torch.isnan(o64), torch.full_like(o64, math.inf), violation)
    top = v.abs().max().item()
    figure = violation.max().item() / top
    # A read through a state, phi(q)^T S / phi(q)^T z, rounds its numerator and denominator apart: K terms more.
    f = formulation(case.name)
    accumulated_terms = case.T + (case.K if f.state is not None and traits.has_query(f) else 0)
    bound = unit_roundoff(dtype) + accumulated_terms * unit_roundoff(torch.float32)
    where = divmod(int(violation.flatten().argmax()), violation[0].numel())
    detail = (f"worst at batch {where[0]}, flat index {where[1]}: o = {o64.flatten()[violation.flatten().argmax()].item():.6g}, "
              f"max |v| = {top:.4g}")
    return CheckResult("convexity", exact(figure <= bound), figure, bound,
                       "max distance outside [min v, max v] / max |v|",
                       target.label, case, dtype, device, detail)


_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def shift_pair(case: Case, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Inputs (unshifted, shifted), both exact in ``dtype``, and the shift actually applied.

    The shifted arguments and the shift are snapped to a grid coarse enough
    that ``k`` and ``k + shift`` are both representable, so the two calls are
    the same function of exactly the same numbers.
    """
    x = case.with_(key_shift=0.0).inputs()
    shifted_args = traits.shift_invariant_args(case.name)
    largest = max(x[a].abs().max().item() for a in shifted_args) + abs(case.key_shift)
    spacing = 2.0 ** (math.floor(math.log2(largest)) - _MANTISSA_BITS[dtype])
    shift = round(case.key_shift / spacing) * spacing
    base = dict(x)
    for a in shifted_args:
        base[a] = torch.round(x[a] / spacing) * spacing
    shifted = {**base, **{a: base[a] + shift for a in shifted_args}}
    for a in shifted_args:
        assert torch.equal(shifted[a].to(dtype).double(), shifted[a]), "shift grid is not exact"
    return base, shifted, shift


def check_shift_invariance(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu") -> CheckResult:
    """Adding one constant to every key (RWKV-4, AFT) leaves the output unchanged, within the excess bound.

    The target runs on the shifted keys; its output is measured against the
    oracle on the unshifted keys, with the conditioning floor of the shifted
    inputs (large keys cost an fp32 algorithm accuracy it cannot recover).
    """
    base, shifted, shift = shift_pair(case, dtype)
    options = case.option_values
    x_base = {**round_to(base, dtype, device), **options}
    x_shifted = {**round_to(shifted, dtype, device), **options}
    reference = _reference(case.name)
    ref = reference(**x_base)
    try:
        o = target(**x_shifted)
    except Exception as error:  # noqa: BLE001
        return _raised("shift_invariance", target, case, dtype, device, error)
    note = f"keys shifted by {shift:+.6g} (exactly, on a grid); compared with the oracle on the unshifted keys"
    return _judge("shift_invariance", target, case, dtype, device, o, ref, lambda: _conditioning_floor(case.name, reference, x_shifted), note)


def check_reduces_to_special_case(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu") -> CheckResult:
    """On the inputs that reduce it to a special case (``case`` is of the special formulation), the target
    matches the special formulation's oracle."""
    reduction = next(r for r in traits.reductions_of(target.formulation) if r.special == case.name)
    x_special = case.call(dtype, device)
    x_general = reduction.to_general(x_special)
    reference = _reference(case.name)
    ref = reference(**x_special)
    try:
        o = target(**x_general)
    except Exception as error:  # noqa: BLE001
        return _raised("reduces_to_special_case", target, case, dtype, device, error)
    note = f"{reduction.general} on {reduction.special}'s inputs ({reduction.label}), against the {reduction.special} oracle"
    return _judge("reduces_to_special_case", target, case, dtype, device, o, ref,
                  lambda: _conditioning_floor(case.name, reference, x_special), note)


# ----------------------------------------------------------------------------- oracle properties (float64)


def check_forms_agree(case: Case, chunk_size: int) -> CheckResult:
    """The float64 oracle's recurrent, parallel and chunkwise forms agree to 1e-12 relative."""
    x = {**case.inputs(), **case.option_values}
    recurrent = oracle(case.name, "recurrent")(**x)
    others = {"parallel": oracle(case.name, "parallel")(**x),
              f"chunkwise(chunk_size={chunk_size})": oracle(case.name, "chunkwise", chunk_size=chunk_size)(**x)}
    errors = {form: rel_err(o, recurrent) for form, o in others.items()}
    worst = max(errors, key=lambda k: errors[k])
    figure = errors[worst] if not math.isnan(errors[worst]) else math.inf
    return CheckResult("forms_agree", exact(figure <= IDENTITY_TOLERANCE), figure, IDENTITY_TOLERANCE,
                       "rel_err against the recurrent form", f"oracle:{case.name}", case, None, "cpu",
                       f"worst form {worst}; " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


def check_oracle_reduction(reduction: traits.Reduction, case: Case) -> CheckResult:
    """Each float64 form of the general formulation, on the reducing inputs, equals the special one's to 1e-12."""
    x = {**case.inputs(), **case.option_values}
    errors = {}
    for form in formulation(case.name).forms:
        opts = {"chunk_size": 8} if form == "chunkwise" else {}
        special = oracle(case.name, form, **opts)(**x)
        general = oracle(reduction.general, form, **opts)(**reduction.to_general(x))
        errors[form] = rel_err(general, special)
    figure = max(errors.values())
    return CheckResult("oracle_reduction", exact(figure <= IDENTITY_TOLERANCE), figure, IDENTITY_TOLERANCE,
                       f"rel_err of {reduction.general} against {reduction.special}", f"oracle:{reduction.label}",
                       case, None, "cpu", ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


def ut_inverse(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, A^-1, bound)`` for the whole sequence as one chunk, heads first ``[B, H, T, T]``.

    ``A = I + tril(Diag(beta) (K K^T * Gamma), -1)`` with the gates folded in
    (``Gamma_ij = exp(G_i - G_j)`` per key channel, FORMULATIONS.md), and
    ``bound_ij = beta_i |k_i| |k_j|``, which bounds ``|A^-1_ij|`` below the
    diagonal whenever ``beta_l |k_l|^2 <= 2`` (every factor ``I - beta k k^T``
    then has norm <= 1): max beta for unit keys.
    """
    f = formulation(case.name)
    x = case.inputs()
    xp = Float64()
    k = x["k"].swapaxes(1, 2)
    beta = x["beta"].swapaxes(1, 2)
    gates = [a.name for a in traits.log_gate_args(f)]
    T = case.T
    mask = xp.tril_mask(T)
    if gates:
        g = x[gates[0]]
        g = (g[..., None] if g.dim() == 3 else g).expand(x["k"].shape).swapaxes(1, 2)
        kk = (k[..., :, None, :] * k[..., None, :, :] * pairwise_decay(xp, g.cumsum(dim=2), mask)).sum(-1)
    else:
        kk = k @ k.mT
    L = torch.where(xp.tril_mask(T, diagonal=-1), beta[..., :, None] * kk, 0.0)
    A = torch.eye(T, dtype=torch.float64) + L
    norms = k.norm(dim=-1)
    bound = beta[..., :, None] * norms[..., :, None] * norms[..., None, :]
    return A, unit_lower_inverse(xp, L), bound


def check_ut_inverse_bounded(case: Case) -> CheckResult:
    """Below the diagonal, ``|(I + L)^-1_ij| <= beta_i |k_i| |k_j|`` (max beta for unit keys); reports cond(I + L)."""
    A, inverse, bound = ut_inverse(case)
    strict = torch.ones(case.T, case.T, dtype=torch.bool).tril(-1)
    ratio = torch.where(strict & (bound > 0), inverse.abs() / bound.clamp_min(1e-300), 0.0)
    figure = ratio.max().item() if case.T > 1 else 0.0
    condition = torch.linalg.cond(A).max().item()
    largest = inverse.masked_fill(~strict, 0).abs().max().item() if case.T > 1 else 0.0
    return CheckResult("ut_inverse_bounded", exact(figure <= UT_ENTRY_BOUND), figure, UT_ENTRY_BOUND,
                       "max |A^-1_ij| / (beta_i |k_i| |k_j|) below the diagonal", f"oracle:{case.name}", case, None,
                       "cpu", f"cond(I + L) = {condition:.3e}, max |A^-1_ij| = {largest:.4g}")


def single_matrix_state(name: str) -> bool:
    """Whether ``name`` has one state matrix ``S [B, H, K, V]`` (the decay-product property needs it)."""
    state = formulation(name).state
    return state is not None and state.parts == (("S", ("B", "H", "K", "V")),)


def check_decay_products_contract(case: Case) -> CheckResult:
    """The product of the state transitions never grows in 2-norm.

    With ``v = 0`` and ``S_0 = I`` (so V = K), the recurrent float64 oracle's
    final state is the product of every step's transition (``Diag(exp g)``,
    ``I - beta k k^T``, ...).
    """
    case = case.with_(V=case.K)
    x = {**case.inputs(), **case.option_values}
    x["v"] = torch.zeros_like(x["v"])
    identity = torch.eye(case.K, dtype=torch.float64).expand(case.B, case.H, case.K, case.K).contiguous()
    _, product = oracle(case.name, "recurrent")(**x, initial_state=identity, return_state=True)
    figure = torch.linalg.matrix_norm(product, ord=2).max().item()
    return CheckResult("decay_products_contract", exact(figure <= CONTRACTION_BOUND), figure, CONTRACTION_BOUND,
                       "max 2-norm of the product of the transitions", f"oracle:{case.name}", case, None, "cpu",
                       f"over {case.T} steps")
