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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from attnlab.metrics import (FAILED, HELD, IMPRECISE, VERDICTS, Measurement, conditioning_floor, grade, measure, norm,
                             nonfinite_count, rel_err, rounding_floor, set_user_bound, unit_roundoff, user_bound, user_bounds, verdict,
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
    "CheckResult", "HELD", "IMPRECISE", "FAILED", "VERDICTS", "IDENTITY_TOLERANCE", "EXCESS_MEASURE", "GRADIENT_MEASURE",
    "bounds", "user_bound",
    "set_user_bound", "grade", "worst_verdict",
    "check_matches_oracle", "check_overflow", "check_causality", "check_chunk_size_invariance",
    "check_split_and_resume", "check_convexity", "check_shift_invariance", "check_reduces_to_special_case",
    "check_forms_agree", "check_oracle_reduction", "check_ut_inverse_bounded", "check_decay_products_contract",
]

IDENTITY_TOLERANCE = 1e-12
# Where an input is so ill-conditioned that float64 roundoff itself moves the exact answer by more than
# IDENTITY_TOLERANCE (normalized linear attention with identity features, whose normalizer q . z can be near 0),
# the forms, which sum in other orders, may differ by a few times that: they must agree within this many times it.
FORMS_CONDITIONED = 16
# float64's spacing at 0 (its smallest subnormal). Outputs that small are rounded to multiples of it, an absolute
# roundoff that perturbing the inputs by 2^-53 relative does not show (the conditioning floor reads 0 there).
FLOAT64_SPACING_AT_ZERO = 2.0**-1074
# What an excess-graded check measures (CheckResult.measure), forward and backward.
EXCESS_MEASURE = "excess = rel_err / floor"
# The float64 reference: the chunkwise oracle (certified by mpmath in tests/test_oracles.py).
ORACLE_CHUNK_SIZE = 64
# The bound on |(I + L)^-1_ij| / (beta_i |k_i| |k_j|), with float64 slack.
UT_ENTRY_BOUND = 1.0 + 1e-9
CONTRACTION_BOUND = 1.0 + 1e-12
RAISED = "the implementation raised"
BACKWARD_RAISED = "the backward raised (refused)"
# A forward that raises NotImplementedError declines the input (Python's "not supported"; torch's pinned SDPA backends
# have no kernel for some shapes): the search skips the case (attnlab.properties.suite), a verdict counts them.
DECLINED = "the kernel declined this input (NotImplementedError)"
# CUDA's "sticky" errors, as torch and Triton word them: after one, the process's CUDA context is lost and every
# later CUDA call fails whatever its input, so a result that failed on one says where the kernel faulted and nothing
# about its arithmetic (attnlab.properties.suite stops there instead of shrinking).
CUDA_FAULTS = ("illegal memory access", "illegal address", "unspecified launch failure", "misaligned address",
               "device-side assert", "illegal instruction", "hardware stack error", "uncorrectable ecc")


def is_cuda_fault(result: CheckResult) -> bool:
    """Whether ``result`` failed on a CUDA error that loses the context (:data:`CUDA_FAULTS`)."""
    return result.failed and any(fault in result.detail.lower() for fault in CUDA_FAULTS)


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
        if self.measure == BACKWARD_RAISED:
            verdict = "FAILED (REFUSED: the kernel's backward raised)"
        figure = (f"  figure: {self.measure} = {self.figure:.4g}    bound: {self.bound_text()}"
                  if self.measure not in (RAISED, BACKWARD_RAISED) else f"  figure: none, {self.measure}")
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
    measure = DECLINED if isinstance(error, NotImplementedError) else RAISED
    return CheckResult(prop, FAILED, math.inf, 0.0, measure, target.label, case, dtype, device,
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
    past_range = (f"; {m.overflowed} past the dtype's range, returned as the infinity they round to and left out of "
                  "the errors" if m.overflowed else "")
    return (f"rel_err {m.rel_err:.3e}, max_err {m.max_err:.3e}, floor_round {m.floor_round:.3e}, "
            f"floor_cond {m.floor_cond:.3e} (computed only when needed), non-finite entries {m.nonfinite} of {o.numel()}"
            + past_range)


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
        return CheckResult(prop, FAILED, math.inf, bound, EXCESS_MEASURE, target.label, case, dtype,
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
    return CheckResult(prop, graded, m.excess, bound, EXCESS_MEASURE, target.label, case, dtype, device,
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
    gap = norm(a.double() - b.double())
    scale = norm(ref)
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
                           EXCESS_MEASURE,
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


def _subnormal_floor(reference: Any, roundings: int) -> float:
    """The normwise relative error of ``roundings`` roundings of FLOAT64_SPACING_AT_ZERO in every element of
    ``reference``: what float64's absolute resolution allows a result that small (negligible unless it is
    subnormal)."""
    elements = sum(p.numel() for p in (reference if isinstance(reference, (tuple, list)) else (reference,)))
    size = norm(reference)  # scaled first: squares of subnormal entries would be 0
    error = roundings * FLOAT64_SPACING_AT_ZERO * math.sqrt(elements)
    return error / size if size > 0 else math.inf


def check_forms_agree(case: Case, chunk_size: int) -> CheckResult:
    """The float64 oracle's recurrent, parallel and chunkwise forms agree to 1e-12 relative, or, on an input where
    float64 roundoff moves the exact answer by more (its conditioning floor at unit 2^-53, or, for subnormal
    outputs, float64's spacing at 0 per rounding), to FORMS_CONDITIONED times that floor."""
    x = {**case.inputs(), **case.option_values}
    recurrent = oracle(case.name, "recurrent")
    reference = recurrent(**x)
    others = {"parallel": oracle(case.name, "parallel")(**x),
              f"chunkwise(chunk_size={chunk_size})": oracle(case.name, "chunkwise", chunk_size=chunk_size)(**x)}
    errors = {form: rel_err(o, reference) for form, o in others.items()}
    worst = max(errors, key=lambda k: errors[k])
    figure = errors[worst] if not math.isnan(errors[worst]) else math.inf
    tolerance, note = IDENTITY_TOLERANCE, ""
    if not figure <= tolerance and math.isfinite(figure):
        floor = conditioning_floor(recurrent, x, unit=2.0**-53, base=reference)
        subnormal = _subnormal_floor(reference, roundings=case.T * max(case.K, case.V))
        tolerance = max(tolerance, FORMS_CONDITIONED * floor, FORMS_CONDITIONED * subnormal)
        note = f"; float64 conditioning floor {floor:.2e}, subnormal floor {subnormal:.2e}, tolerance {tolerance:.2e}"
    return CheckResult("forms_agree", exact(figure <= tolerance), figure, tolerance,
                       "rel_err against the recurrent form", f"oracle:{case.name}", case, None, "cpu",
                       f"worst form {worst}; " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()) + note)


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


# ----------------------------------------------------------------------------- gradients (issue 22)
#
# The backward pass, one property per (check, gradient): DESIGN.md "Gradients (the second pass)". Cotangents are
# drawn from the case's seed (do in o's dtype; with a state, an initial state drawn as a valid state and a
# final-state cotangent of its scale-free parts, attnlab.gradients.log_scale_cotangent). The reference is float64
# autograd through the chunkwise oracle (attnlab.gradients.oracle_gradients); each gradient's excess is over the
# larger of its rounding floor (in the dtype it is returned in) and its conditioning floor, graded by the entry's
# gradient bounds (spec.Bounds.gradients). A backward that raises is failed with measure BACKWARD_RAISED (attnlab
# validate calls it "refused"); no gradient, or one of the wrong shape or dtype, is failed with its message.

GRADIENT_MEASURE = "gradient excess = rel_err / floor"
STATE_GRADIENT = "dinitial_state"
_GRADIENT_RUNS: dict[tuple[Any, ...], Any] = {}
_GRADIENT_RUNS_KEPT = 64


def gradient_label(name: str) -> str:
    """The gradient of input ``name`` as reports name it: ``dq``, ``dbeta``, ``dinitial_state``."""
    return "d" + name


def gradient_names(target: Target) -> list[str]:
    """The gradients of ``target``: one per differentiable argument of its entry, and the initial state's when it
    takes one."""
    f = target.entry
    return [gradient_label(a.name) for a in f.args if a.differentiable] + ([STATE_GRADIENT] if target.accepts_state else [])


def gradient_bounds(name: str, dtype: torch.dtype) -> tuple[float, float]:
    """``(accuracy, correctness)`` for ``name``'s gradients in ``dtype``: the entry's gradient bounds, or the user's
    accuracy bound where one is in force (:func:`user_bound`)."""
    registry = bounds_for(formulation(name), _dtype_name(dtype))
    given = user_bounds(registry)
    accuracy, correctness = registry.gradients
    if given is not registry:
        return given.accuracy, max(correctness, given.accuracy)
    return accuracy, correctness


@dataclass
class GradientRun:
    """One backward pass of a target on one case, and the float64 reference it is measured against.

    ``grads`` maps a gradient label to the kernel's gradient (None when it gave none); ``problems`` a label to
    what is wrong with it; ``error`` is set when the forward or the backward raised (``refused``: the backward;
    ``declined``: the forward raised NotImplementedError, :data:`DECLINED`).
    ``reference`` maps a label to the float64 gradient; ``dtypes`` to the dtype it is returned in; ``floors``
    (lazily, :meth:`floor`) to its conditioning floor. ``inputs`` are the kernel's inputs (rounded), ``o`` its
    output, ``do`` the cotangent; ``positions`` the time positions its gradients cover (a prefix for causality).
    """

    inputs: dict[str, Any]
    do: torch.Tensor
    grads: dict[str, Any] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    missing_parts: dict[str, list[int]] = field(default_factory=dict)  # label -> the parts the backward gave None for
    error: str = ""
    refused: bool = False
    declined: bool = False
    o: Any = None
    reference: dict[str, Any] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    note: str = ""
    floor_inputs: tuple[Any, ...] = ()
    floors: dict[str, float] | None = None

    def floor(self, label: str) -> float:
        """The conditioning floor of gradient ``label`` (computed once for all gradients, when first asked)."""
        if self.floors is None:
            from attnlab.gradients import gradient_floor

            name, x, do, d_final = self.floor_inputs
            base = {n: self.reference[gradient_label(n)] for n in
                    [n for n in (a.name for a in formulation(name).args) if gradient_label(n) in self.reference]
                    + (["initial_state"] if STATE_GRADIENT in self.reference else [])}
            floors = gradient_floor(name, x, do, d_final, base=base, chunk_size=ORACLE_CHUNK_SIZE)
            self.floors = {gradient_label(n): v for n, v in floors.items()}
        return self.floors.get(label, 0.0)


def _cotangent(case: Case, shape: tuple[int, ...], dtype: torch.dtype, device: str, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.seed * 7919 + 31 * salt + 5)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def _drawn_state(case: Case) -> Any:
    """A valid initial state for ``case``: the float64 oracle's final state on a short run of another seed."""
    head = case.with_(seed=case.seed + 1, T=min(case.T, 4), cut=None)
    x = {**head.inputs(), **head.option_values}
    return oracle(case.name, "recurrent")(**x, return_state=True)[1]


def _output_shape(case: Case, x: Mapping[str, Any]) -> tuple[int, ...]:
    value = formulation(case.name).args_with_role("value")[0].name
    return tuple(x[value].shape)


def _kernel_backward(target: Target, call: dict[str, Any], leaves: dict[str, tuple[torch.Tensor, ...]],
                     run: GradientRun, forward: Callable[[dict[str, Any]], tuple[Any, tuple[Any, ...]]],
                     d_final: Callable[[tuple[Any, ...]], tuple[torch.Tensor, ...] | None]) -> None:
    """Run ``forward(call) -> (o, final parts)`` and the backward from ``run.do`` (and ``d_final(final)``), filling
    ``run.grads`` / ``run.problems`` / ``run.error``."""
    try:
        with torch.enable_grad():
            o, final = forward(call)
    except Exception as error:  # noqa: BLE001 - the implementation's failure is a finding
        where = traceback.extract_tb(error.__traceback__)[-1]
        run.error = f"the forward raised {type(error).__name__}: {error} (at {where.filename}:{where.lineno})"
        run.declined = isinstance(error, NotImplementedError)
        return
    run.o = o
    if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(run.do.shape):
        got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
        run.error = f"returned o {got}, expected a tensor of shape {tuple(run.do.shape)}"
        return
    if not o.requires_grad:
        run.error = "the output does not require grad: the kernel is not differentiable on these inputs"
        return
    outputs, cotangents = [o], [run.do.to(o.dtype)]
    d_parts = d_final(final) if final else None
    if d_parts is not None:
        for part, d in zip(final, d_parts):
            if isinstance(part, torch.Tensor) and part.requires_grad:
                outputs.append(part)
                cotangents.append(d.to(device=part.device, dtype=part.dtype))
    labels = [label for label in leaves for _ in leaves[label]]
    flat = [leaf for label in leaves for leaf in leaves[label]]
    try:
        grads = torch.autograd.grad(outputs, flat, cotangents, allow_unused=True)
    except Exception as error:  # noqa: BLE001
        text = f"{type(error).__name__}: {error}"
        run.error = f"the backward raised {text}"
        run.refused = "invalid gradient" not in str(error)  # autograd's own shape/dtype check: a wrong gradient
        return
    collected: dict[str, list[Any]] = {}
    for label, leaf, g in zip(labels, flat, grads):
        collected.setdefault(label, []).append(g)
        if g is None:  # a problem unless the float64 gradient is exactly zero (an input the run does not use)
            run.problems[label] = f"the backward returned no gradient for {label[1:]} (None)"
            run.missing_parts.setdefault(label, []).append(len(collected[label]) - 1)
            collected[label][-1] = torch.zeros_like(leaf)
        elif tuple(g.shape) != tuple(leaf.shape):
            run.problems[label] = f"{label} has shape {tuple(g.shape)}, expected {tuple(leaf.shape)}"
        elif g.dtype != leaf.dtype:
            run.problems[label] = f"{label} is {_dtype_name(g.dtype)}, expected {_dtype_name(leaf.dtype)}"
    for label, parts in collected.items():
        run.grads[label] = parts[0] if len(parts) == 1 else tuple(parts)


def gradient_run(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu", mode: str = "full",
                 chunk_size: int | None = None) -> GradientRun:
    """The target's gradients on ``case`` and their float64 reference (cached: one backward serves every gradient's
    property). ``mode``: "full" (an initial state and a final-state cotangent when the target takes a state),
    "plain" (neither), "causal" (do zero from ``case.cut`` on; the reference is the prefix run's), "split" (the
    run split at ``case.cut`` and resumed from the returned state; the reference is the whole run's)."""
    key = (id(target), target.label, repr(case), dtype, device, mode, chunk_size)
    if key in _GRADIENT_RUNS:
        return _GRADIENT_RUNS[key]
    from attnlab.gradients import log_scale_cotangent, oracle_gradients

    f = formulation(case.name)
    x = case.call(dtype, device)
    do = _cotangent(case, _output_shape(case, x), dtype, device, 0)
    cut = case.cut if mode in ("causal", "split") else None
    if mode == "causal":
        assert cut is not None, "backward causality needs a case with a cut"
        do[:, cut:] = 0
    run = GradientRun(x, do)
    differentiable = [a.name for a in f.args if a.differentiable and isinstance(x.get(a.name), torch.Tensor)]
    leaves = {gradient_label(n): (x[n].detach().clone().requires_grad_(),) for n in differentiable}
    call = {**x, **{n: leaves[gradient_label(n)][0] for n in differentiable}}
    stateful = mode == "full" and target.accepts_state
    # Split: an input without a time axis goes to both calls, each with its own leaf (its gradient is the two
    # calls' sum, each rounded once: the check's floor says so).
    timeless = [n for n in differentiable if not traits.time_axes(f.arg(n))] if mode == "split" else []
    for n in timeless:
        leaves[gradient_label(n)] += (x[n].detach().clone().requires_grad_(),)
    state64 = _drawn_state(case) if stateful else None
    if state64 is not None:
        parts = tuple(p.to(device=device, dtype=torch.float32).requires_grad_() for p in f.state.split(state64))
        leaves[STATE_GRADIENT] = parts
        call["initial_state"] = f.state.join(parts)
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}
    d_scaled = (tuple(_cotangent(case, tuple(p.shape), torch.float64, "cpu", 1 + i)
                      for i, p in enumerate(f.state.split(state64)) if not f.state.is_log_scale(i))
                if stateful else None)
    log_scale = stateful and any(f.state.is_log_scale(i) for i in range(len(f.state.parts)))
    final64 = None
    if log_scale:
        # The loss <dA, e^(p - m) a> + <dB, e^(p - m) b>, m the largest log-scale of the oracle's final state: the
        # same function of the state whatever its representation, and of order one (e^p alone overflows fp32 for
        # keys shifted past 88).
        reference_state_x = {**x, "initial_state": f.state.join(tuple(p.detach() for p in leaves[STATE_GRADIENT]))}
        final64 = _reference(case.name)(**reference_state_x, return_state=True)[1]
        final64 = f.state.join(tuple(p.detach().double().cpu() for p in f.state.split(final64)))  # beside d_scaled
        logs = [p for i, p in enumerate(f.state.split(final64)) if f.state.is_log_scale(i)][0]
        finite = logs[torch.isfinite(logs)]
        m = float(finite.max()) if finite.numel() else 0.0
        d_scaled = tuple(d * math.exp(-m) for d in d_scaled)
    kernel_d_final: list[Any] = [None]

    def forward(c: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
        if mode == "split":
            head, tail = split_time(case.name, c, cut)
            tail.update({n: leaves[gradient_label(n)][1] for n in timeless})
            o_head, state = target(**head, return_state=True, **extra)
            o_tail = target(**tail, initial_state=state, return_state=True, **extra)[0]
            return torch.cat([o_head, o_tail], dim=1), ()
        if stateful:
            o, final = target(**c, return_state=True, **extra)
            return o, f.state.split(final)
        return target(**c, **extra), ()

    def d_final(final: tuple[Any, ...]) -> tuple[torch.Tensor, ...] | None:
        if d_scaled is None or any(p is None for p in final):
            return None  # a kernel state that omits parts gets no final-state cotangent
        d = log_scale_cotangent(f, f.state.join(tuple(p.detach().double().cpu() for p in final)), f.state.join(d_scaled))
        kernel_d_final[0] = d
        return f.state.split(d)

    _kernel_backward(target, call, leaves, run, forward, d_final)
    # The float64 reference.
    reference_x = {k: v for k, v in x.items()}
    reference_do = do
    if mode == "causal":
        reference_x, _ = split_time(case.name, x, cut)
        reference_do = do[:, :cut]
        run.note = f"do zero from position {cut} of {case.T}; the gradients before it against the prefix run's"
    elif mode == "split":
        run.note = f"split at {case.cut} of {case.T} and resumed from the returned state"
    if stateful:
        reference_x["initial_state"] = f.state.join(tuple(p.detach() for p in leaves[STATE_GRADIENT]))
    d_reference = None
    if stateful and kernel_d_final[0] is not None:
        if final64 is not None:
            d_reference = log_scale_cotangent(f, final64, f.state.join(d_scaled))
        else:
            d_reference = f.state.join(d_scaled)
        run.note = "with a drawn initial state and a final-state cotangent"
    reference = oracle_gradients(f, reference_x, reference_do, d_reference, chunk_size=ORACLE_CHUNK_SIZE)
    run.reference = {gradient_label(n): g for n, g in reference.items()}
    timeless_labels = {gradient_label(n) for n in timeless}
    for label in list(run.problems):
        # A part without a gradient is fine where the reference is exactly zero (a state part the kernel's options
        # leave unused, as linear attention's normalizer z without normalize), or one call of two does not use it
        # (an input without a time axis has a leaf per call, its reference one part: the sum is judged instead).
        if "no gradient" not in run.problems[label]:
            continue
        parts = (run.reference[label],) if isinstance(run.reference.get(label), torch.Tensor) else run.reference.get(label)
        unused = parts is not None and all(i < len(parts) and not bool(parts[i].any())
                                           for i in run.missing_parts.get(label, ()))
        if label in timeless_labels or unused:
            del run.problems[label]
    from attnlab.gradients import gradient_dtypes

    run.dtypes = {gradient_label(n): d for n, d in gradient_dtypes(f, reference_x).items()}
    if STATE_GRADIENT in run.dtypes:
        # Returned in fp32 but built from intermediates in the input dtype, as the final state is (FORMULATIONS.md
        # section 7, "final state"): its rounding floor is the input dtype's.
        run.dtypes[STATE_GRADIENT] = dtype
    run.floor_inputs = (case.name, reference_x, reference_do, d_reference)
    if len(_GRADIENT_RUNS) >= _GRADIENT_RUNS_KEPT:
        _GRADIENT_RUNS.pop(next(iter(_GRADIENT_RUNS)))
    _GRADIENT_RUNS[key] = run
    return run


def _gradient_failure(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, run: GradientRun,
                      label: str) -> CheckResult | None:
    """The failed result of a run that raised, or of a gradient that is missing or malformed; None otherwise."""
    accuracy, correctness = gradient_bounds(target.formulation, dtype)
    if run.error:
        measure = (DECLINED if run.declined else BACKWARD_RAISED if run.refused else RAISED if "raised" in run.error
                   else GRADIENT_MEASURE)
        return CheckResult(prop, FAILED, math.inf, accuracy, measure, target.label, case, dtype, device, run.error,
                           correctness)
    if label in run.problems:
        return CheckResult(prop, FAILED, math.inf, accuracy, GRADIENT_MEASURE, target.label, case, dtype, device,
                           run.problems[label], correctness)
    return None


def _prepared(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, gradient: str,
              mode: str) -> tuple[GradientRun, CheckResult | None]:
    """The run of ``mode`` (:func:`gradient_run`), and the result to return at once, if any: failed when the run
    raised or the gradient is missing or malformed, held when ``gradient`` is not an input of the case."""
    run = gradient_run(target, case, dtype, device, mode)
    early = _gradient_failure(prop, target, case, dtype, device, run, gradient)
    if early is None and gradient not in run.reference:
        early = _vacuous(prop, target, case, dtype, device, f"{gradient[1:]} is not an input of this case")
    return run, early


def _vacuous(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, why: str) -> CheckResult:
    return CheckResult(prop, HELD, 0.0, gradient_bounds(target.formulation, dtype)[0], GRADIENT_MEASURE, target.label,
                       case, dtype, device, why)


def _zero_gradient(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, label: str, mine: Any,
                   ref: Any) -> CheckResult | None:
    """A held (vacuous) result when the exact gradient is identically zero and the kernel's is finite, else None.

    Such a gradient (softmax's dq and dk at T = 1 or over a one-position prefix) has no relative error: both floors
    are 0, and any rounding at all, even fp32 accumulation noise in a kernel that forms D = rowsum(dO o) from its
    rounded output, would read as an infinite excess. The case says nothing about accuracy, so the search goes on;
    backward_finite judges finiteness, and backward_causality checks the positions that must be exactly zero.
    """
    parts = lambda x: (x,) if isinstance(x, torch.Tensor) else tuple(x)  # noqa: E731
    if not all(bool((r == 0).all()) for r in parts(ref)) or not all(bool(torch.isfinite(g).all()) for g in parts(mine)):
        return None
    size = norm(mine)
    return _vacuous(prop, target, case, dtype, device, f"the exact {label} is identically zero here: no relative "
                    f"error to measure (the kernel's |{label}| = {size:.3e})")


# A conditioning floor this large says the float64 gradient is rounding noise around an exact zero: it moves by half
# its own size when the inputs move at fp32 roundoff (a real gradient moves by about that roundoff times its
# conditioning). Seen: normalized linear attention at K = 1, whose output does not depend on q at all.
NOISE_CONDITIONING = 0.5


def _float64_noise(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, label: str,
                   floor_cond: float) -> CheckResult | None:
    """A held (vacuous) result when the float64 gradient is noise around an exact zero (its conditioning floor is at
    least :data:`NOISE_CONDITIONING`), else None: no relative error to measure, as in :func:`_zero_gradient`."""
    if not floor_cond >= NOISE_CONDITIONING:
        return None
    return _vacuous(prop, target, case, dtype, device, f"the exact {label} is zero up to float64 rounding here (its "
                    f"conditioning floor is {floor_cond:.2g}): no relative error to measure")


def _judge_gradient(prop: str, target: Target, case: Case, dtype: torch.dtype, device: str, run: GradientRun,
                    label: str, mine: Any, ref: Any, floor: Callable[[], float], note: str = "",
                    factor: float = 1.0) -> CheckResult:
    accuracy, correctness = (factor * b for b in gradient_bounds(target.formulation, dtype))
    zero = _zero_gradient(prop, target, case, dtype, device, label, mine, ref)
    if zero is not None:
        return zero
    m = measure(mine, ref, run.dtypes[label])
    if m.nonfinite == 0 and not m.excess <= accuracy:
        m = measure(mine, ref, run.dtypes[label], floor())
        noise = _float64_noise(prop, target, case, dtype, device, label, m.floor_cond)
        if noise is not None:
            return noise
    graded = verdict(m, accuracy, correctness)
    size = sum(p.numel() for p in ((mine,) if isinstance(mine, torch.Tensor) else mine))
    detail = f"{label}: " + _measurement_detail(m, torch.empty(size)) + "; " + "; ".join(x for x in (run.note, note) if x)
    if m.nonfinite:
        detail = f"NaN or inf in {label} where the float64 gradient is finite; " + detail
    return CheckResult(prop, graded, m.excess, accuracy, GRADIENT_MEASURE, target.label, case, dtype, device,
                       detail.rstrip("; "), correctness)


def check_backward_matches_oracle(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                                  gradient: str = "dq", *, prop: str | None = None) -> CheckResult:
    """Gradient ``gradient`` against float64 autograd through the oracle (with a drawn initial state and a
    final-state cotangent when the target takes a state): excess within the gradient bounds, finite where it is."""
    prop = prop or f"backward_matches_oracle[{gradient}]"
    run, early = _prepared(prop, target, case, dtype, device, gradient, "full")
    if early is not None:
        return early
    return _judge_gradient(prop, target, case, dtype, device, run, gradient, run.grads[gradient],
                           run.reference[gradient], lambda: run.floor(gradient))


def check_backward_finite(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                          gradient: str = "dq") -> CheckResult:
    """Gradient ``gradient`` has no NaN or inf where the float64 gradient is finite."""
    prop = f"backward_finite[{gradient}]"
    run, early = _prepared(prop, target, case, dtype, device, gradient, "full")
    if early is not None:
        return early
    count = nonfinite_count(run.grads[gradient], run.reference[gradient])
    return CheckResult(prop, exact(count == 0), float(count), 0.0, "non-finite entries where the oracle is finite",
                       target.label, case, dtype, device, f"{gradient}; {run.note}".rstrip("; "))


def _norm(x: Any) -> float:
    return norm(x)


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() * b.detach().double().cpu()).sum())


def check_backward_query_identity(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                                  gradient: str = "dq") -> CheckResult:
    """``<q, dq> = <o, do>`` where ``o`` is linear in ``q`` (Formulation.linear_in_query_when): oracle-free.

    Figure: the residual over ``u (|q| |dq| + |o| |do|)``, what rounding ``dq`` and ``o`` once can leave (where
    that does not hold, ``u`` for dq is raised to its conditioning floor); graded by the gradient bounds."""
    prop = f"backward_query_identity[{gradient}]"
    f = formulation(case.name)
    if not f.is_linear_in_query(dict(case.options)):
        return _vacuous(prop, target, case, dtype, device, "o is not linear in q under these options")
    run, early = _prepared(prop, target, case, dtype, device, gradient, "full")
    if early is not None:
        return early
    query = f.args_with_role("query")[0].name
    q, dq, o = run.inputs[query], run.grads[gradient], run.o
    residual = abs(_dot(q, dq) - _dot(o, run.do))
    if not math.isfinite(residual):
        residual = math.inf
    u = unit_roundoff(dtype)
    accuracy, correctness = gradient_bounds(target.formulation, dtype)
    scale_q, scale_o = _norm(q) * _norm(dq), _norm(o) * _norm(run.do)
    floor = u * (scale_q + scale_o)
    figure = _ratio(residual, floor)
    note = ""
    if not figure <= accuracy:
        floor = max(u, run.floor(gradient)) * scale_q + u * scale_o
        figure, note = _ratio(residual, floor), f"; dq's conditioning floor {run.floor(gradient):.3e}"
    detail = (f"<q, dq> = {_dot(q, dq):.9g}, <o, do> = {_dot(o, run.do):.9g}, residual {residual:.3e} over "
              f"{floor:.3e}{note}; {run.note}").rstrip("; ")
    return CheckResult(prop, grade(figure, accuracy, correctness), figure, accuracy,
                       "|<q, dq> - <o, do>| / rounding floor", target.label, case, dtype, device, detail, correctness)


def keys_shift_invariant(f: Any, name: str) -> bool:
    """Whether adding one constant to every key ``name`` of ``f`` (every position) leaves ``o`` unchanged, so that
    the sum over positions of its gradient is zero: the entry's ``shift_invariant`` arguments (RWKV-4, AFT: the
    constant multiplies every weight of a normalized average), and the key of bilinear logits (softmax: one vector
    added to every key adds ``scale q_t.a`` to every logit of row t, which the row's normalization cancels)."""
    f = formulation(f) if isinstance(f, str) else f
    keys = [a.name for a in f.args_with_role("key")]
    return name in f.shift_invariant or (f.bilinear_logits and name in keys)


def check_backward_shift_identity(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                                  gradient: str = "dk") -> CheckResult:
    """The sum over positions of ``dk`` is zero where one constant added to every key changes nothing
    (:func:`keys_shift_invariant`: RWKV-4, AFT, softmax per batch and head); no initial state. Figure: ``|sum_t dk_t|`` over
    ``u sqrt(T) |dk|`` (one rounding of dk), graded by the gradient bounds."""
    prop = f"backward_shift_identity[{gradient}]"
    f = formulation(case.name)
    run, early = _prepared(prop, target, case, dtype, device, gradient, "plain")
    if early is not None:
        return early
    zero = _zero_gradient(prop, target, case, dtype, device, gradient, run.grads[gradient], run.reference[gradient])
    if zero is not None:
        return zero
    axis = traits.time_axes(f.arg(gradient[1:]))[0]
    dk = run.grads[gradient].detach().double().cpu()
    residual = norm(dk.sum(dim=axis)) if bool(torch.isfinite(dk).all()) else math.inf
    u = unit_roundoff(dtype)
    accuracy, correctness = gradient_bounds(target.formulation, dtype)
    floor = u * math.sqrt(case.T) * norm(dk) if math.isfinite(residual) else 0.0
    figure = _ratio(residual, floor)
    if not figure <= accuracy and math.isfinite(residual):
        floor = max(u, run.floor(gradient)) * math.sqrt(case.T) * _norm(run.reference[gradient])
        figure = _ratio(residual, floor)
    return CheckResult(prop, grade(figure, accuracy, correctness), figure, accuracy,
                       "|sum_t dk_t| / rounding floor", target.label, case, dtype, device,
                       f"|sum_t {gradient}_t| = {residual:.3e}, floor {floor:.3e}, |{gradient}| = {norm(dk):.3e}",
                       correctness)


def check_backward_causality(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                             gradient: str = "dq") -> CheckResult:
    """With ``do`` zero from position ``cut`` on (no state, no final-state cotangent), gradient ``gradient`` is
    exactly zero at every position >= cut, and before it matches the prefix run's float64 gradient."""
    prop = f"backward_causality[{gradient}]"
    assert case.cut is not None, "backward causality needs a case with a cut"
    f = formulation(case.name)
    run, early = _prepared(prop, target, case, dtype, device, gradient, "causal")
    if early is not None:
        return early
    g = run.grads[gradient]
    axes = traits.time_axes(f.arg(gradient[1:]))
    prefix = g
    if axes:
        changed = torch.zeros((), dtype=torch.int64)
        for axis in axes:
            changed = changed + (g.narrow(axis, case.cut, g.shape[axis] - case.cut) != 0).sum().cpu()
            prefix = prefix.narrow(axis, 0, case.cut)
        if int(changed):
            return CheckResult(prop, FAILED, float(changed), 0.0, "gradient entries at positions >= cut not zero",
                               target.label, case, dtype, device,
                               f"{int(changed)} entries of {gradient} at positions >= {case.cut} are not exactly zero "
                               f"though do is zero there: the backward lets a later position's do reach them")
    return _judge_gradient(prop, target, case, dtype, device, run, gradient, prefix, run.reference[gradient],
                           lambda: run.floor(gradient))


def check_backward_split_and_resume(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                                    gradient: str = "dq") -> CheckResult:
    """Gradients through a run split at ``cut`` and resumed from the returned state (so through the state's
    gradient, d initial_state) match the whole run's float64 gradients. The gradient of an input without a time
    axis (retnet's g, RWKV-4's w and u) is the sum of the two calls' gradients (each call gets its own leaf), each
    rounded once to its dtype: its floor is at least ``u (|g_head| + |g_tail|) / |g|``."""
    prop = f"backward_split_and_resume[{gradient}]"
    assert case.cut is not None, "split_and_resume needs a case with a cut"
    run, early = _prepared(prop, target, case, dtype, device, gradient, "split")
    if early is not None:
        return early
    mine, floor, note = run.grads[gradient], (lambda: run.floor(gradient)), ""
    if isinstance(mine, tuple):  # an input of both calls: the sum of their gradients, each rounded once
        parts = [p.detach().double().cpu() for p in mine]
        mine = parts[0] + parts[1]
        scale = _norm(run.reference[gradient])
        rounded = (unit_roundoff(run.dtypes[gradient]) * sum(_norm(p) for p in parts) / scale) if scale > 0 else 0.0
        floor = lambda: max(run.floor(gradient), rounded)  # noqa: E731
        note = f"{gradient} of both calls summed; floor of rounding each once {rounded:.3e}"
    return _judge_gradient(prop, target, case, dtype, device, run, gradient, mine, run.reference[gradient], floor,
                           note)


def check_backward_chunk_size_invariance(target: Target, case: Case, dtype: torch.dtype, device: str = "cpu",
                                         gradient: str = "dq") -> CheckResult:
    """Every accepted chunk size gives the same gradient: pairwise differences over the float64 gradient's floor,
    against twice the gradient bounds."""
    prop = f"backward_chunk_size_invariance[{gradient}]"
    runs = {c: gradient_run(target, case, dtype, device, "plain", c) for c in target.chunk_sizes}
    for run in runs.values():
        failure = _gradient_failure(prop, target, case, dtype, device, run, gradient)
        if failure is not None:
            return failure
    first = next(iter(runs.values()))
    if gradient not in first.reference:
        return _vacuous(prop, target, case, dtype, device, f"{gradient[1:]} is not an input of this case")
    ref = first.reference[gradient]
    floor = max(rounding_floor(ref, first.dtypes[gradient]), 0.0)
    accuracy, correctness = gradient_bounds(target.formulation, dtype)
    sizes = list(runs)
    worst, pair = 0.0, (sizes[0], sizes[0])
    for i, a in enumerate(sizes):
        for b in sizes[i + 1:]:
            figure = _ratio(_difference_over(runs[a].grads[gradient], runs[b].grads[gradient], ref), floor)
            figure = math.inf if math.isnan(figure) else figure
            if figure > worst:
                worst, pair = figure, (a, b)
    if not worst <= 2 * accuracy:
        noise = _float64_noise(prop, target, case, dtype, device, gradient, first.floor(gradient))
        if noise is not None:
            return noise
        floor = max(floor, first.floor(gradient))
        worst = _ratio(_difference_over(runs[pair[0]].grads[gradient], runs[pair[1]].grads[gradient], ref), floor)
        worst = math.inf if math.isnan(worst) else worst
    return CheckResult(prop, grade(worst, 2 * accuracy, 2 * correctness), worst, 2 * accuracy,
                       "|g_c1 - g_c2| / |ref| / floor", target.label, case, dtype, device,
                       f"{gradient}: worst pair chunk sizes {pair[0]} and {pair[1]} of {sizes}", 2 * correctness)


BACKWARD_CHECKS = {
    "backward_matches_oracle": check_backward_matches_oracle,
    "backward_finite": check_backward_finite,
    "backward_query_identity": check_backward_query_identity,
    "backward_shift_identity": check_backward_shift_identity,
    "backward_causality": check_backward_causality,
    "backward_chunk_size_invariance": check_backward_chunk_size_invariance,
    "backward_split_and_resume": check_backward_split_and_resume,
}
__all__ += ["keys_shift_invariant", "BACKWARD_RAISED", "CUDA_FAULTS", "is_cuda_fault", "BACKWARD_CHECKS", "GradientRun", "gradient_run", "gradient_names", "gradient_bounds",
            "check_backward_matches_oracle", "check_backward_finite", "check_backward_query_identity",
            "check_backward_shift_identity", "check_backward_causality", "check_backward_split_and_resume",
            "check_backward_chunk_size_invariance"]
