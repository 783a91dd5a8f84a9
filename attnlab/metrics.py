"""How error is measured (DESIGN.md, "Measuring error").

- ``rel_err = |o - ref|_F / |ref|_F`` (normwise), and the max elementwise
  error over ``|ref|_inf``; non-finite outputs where the reference is finite
  are counted on their own and make every error infinite.
- ``floor_round``: the error of rounding the exact answer once to the output
  dtype, ``|round_dtype(ref) - ref|_F / |ref|_F``.
- ``floor_cond``: the float64 oracle's relative change when every input is
  perturbed by one unit roundoff of fp32 (the kernels' accumulation
  precision) in a few random directions; no fp32 algorithm can beat it.
- ``excess = rel_err / max(floor_round, floor_cond)``: 1.0 is a perfect kernel.
- An entry whose exact value lies beyond the output dtype's range (a parameter's
  gradient summed over every position can pass fp16's 65504) rounds to an
  infinity: there the output must be that same infinity, which is its correct
  rounding, and any other value is counted with the non-finite entries. Such
  entries are counted as ``overflowed`` and left out of the norms above.

Verdicts grade an excess by two bounds (attnlab.registry.BOUNDS, per dtype):
``held`` within the accuracy bound, ``imprecise`` above it up to the
correctness bound (the right function, less accurately than the bound
allows), ``failed`` above the correctness bound or with any non-finite entry
where the reference is finite (another function, or a broken one).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from attnlab.spec import Bounds

HELD, IMPRECISE, FAILED = "held", "imprecise", "failed"
VERDICTS = (HELD, IMPRECISE, FAILED)  # from best to worst
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def _as_parts(x: Any) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _flat(x: Any) -> torch.Tensor:
    return torch.cat([p.detach().to(torch.float64).flatten().cpu() for p in _as_parts(x)])


def nonfinite_count(o: Any, ref: Any) -> int:
    """Entries of ``o`` that are NaN or inf where ``ref`` is finite."""
    o, ref = _flat(o), _flat(ref)
    return int((~torch.isfinite(o) & torch.isfinite(ref)).sum())


def norm(x: Any) -> float:
    """The Frobenius norm of a tensor or parts, scaled by the largest entry first: torch's own squares float64
    entries below 1e-154 to 0 (an exact softmax gradient of 1e-280 has norm 0 there) and above 1e154 to inf."""
    flat = _flat(x)
    if flat.numel() == 0:
        return 0.0
    scale = flat.abs().max().item()
    if scale == 0 or not math.isfinite(scale):
        return scale
    return scale * (flat / scale).norm().item()


def rel_err(o: Any, ref: Any) -> float:
    """Normwise relative error ``|o - ref|_F / |ref|_F``; inf when ``o`` has a non-finite entry."""
    o, ref = _flat(o), _flat(ref)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    denominator = norm(ref)
    difference = norm(o - ref)
    return difference / denominator if denominator > 0 else (0.0 if difference == 0 else math.inf)


def max_err(o: Any, ref: Any) -> float:
    """``max |o - ref| / max |ref|``; inf when ``o`` has a non-finite entry, 0 when there is none (as ``norm``)."""
    o, ref = _flat(o), _flat(ref)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    if ref.numel() == 0:
        return 0.0
    scale = ref.abs().max().item()
    difference = (o - ref).abs().max().item()
    return difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)


def rounding_floor(ref: Any, dtype: torch.dtype) -> float:
    """The relative error of rounding the exact ``ref`` once to ``dtype``."""
    return rel_err([p.to(dtype).to(torch.float64) for p in _as_parts(ref)], ref)


def conditioning_floor(
    reference: Callable[..., Any],
    inputs: Mapping[str, Any],
    *,
    trials: int = 3,
    unit: float = UNIT_ROUNDOFF[torch.float32],
    seed: int = 0,
    base: Any = None,
) -> float:
    """Largest relative change of ``reference(**inputs)`` under componentwise input perturbations of size ``unit``.

    Each floating tensor ``x`` becomes ``x * (1 + unit * r)`` with ``r``
    uniform in [-1, 1]; non-tensor inputs are passed unchanged. When
    ``reference`` is an attnlab oracle, perturbed values are clamped into
    their argument's valid range (beta = 2 stays 2, a log gate stays <= 0),
    and, when every floating input has the batch dimension first, the trials
    run as one call on the inputs stacked along it (sequences are independent,
    so each trial's output is its slice: one pass of a recurrent oracle, whose
    cost is its token loop, instead of ``trials``). ``base``: the already
    computed ``reference(**inputs)``, if any.
    """
    spec = getattr(reference, "formulation", None)
    args = {a.name: a for a in spec.args} if spec is not None else {}
    if base is None:
        base = reference(**inputs)
    generator = torch.Generator().manual_seed(seed)
    tensors = [name for name, value in inputs.items() if isinstance(value, torch.Tensor)]
    nested = any(isinstance(value, (tuple, list)) for value in inputs.values())  # an initial state: not stacked
    if trials > 1 and tensors and not nested and all(inputs[name].dtype.is_floating_point and name in args
                                                     and args[name].dims[:1] == ("B",) for name in tensors):
        perturbed = [_perturbed(inputs, args, unit, generator) for _ in range(trials)]
        stacked = {name: torch.cat([p[name] for p in perturbed]) if name in tensors else value
                   for name, value in inputs.items()}
        parts = [part.chunk(trials) for part in _as_parts(reference(**stacked))]
        return max(rel_err([chunks[i] for chunks in parts], base) for i in range(trials))
    # One perturbed copy at a time: an input without a batch dimension can be large (aft's [T, T] position bias).
    return max(rel_err(reference(**_perturbed(inputs, args, unit, generator)), base) for _ in range(trials))


def _perturbed(inputs: Mapping[str, Any], args: Mapping[str, Any], unit: float, generator: torch.Generator) -> dict[str, Any]:
    """One random perturbation of every floating tensor by ``unit`` componentwise, clamped into its argument's range."""
    moved = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            r = torch.rand(value.shape, generator=generator, dtype=torch.float64).to(value.device) * 2 - 1
            arg = args.get(name)
            x = value.to(torch.float64) * (1 + unit * r)
            moved[name] = x if arg is None or (arg.low is None and arg.high is None) else x.clamp(min=arg.low, max=arg.high)
        else:
            moved[name] = value
    return moved


@dataclass(frozen=True)
class Measurement:
    """Error of one output against its reference, and the floors it is judged by."""

    rel_err: float
    max_err: float
    floor_round: float
    floor_cond: float
    nonfinite: int
    overflowed: int = 0

    @property
    def floor(self) -> float:
        return max(self.floor_round, self.floor_cond)

    @property
    def excess(self) -> float:
        return self.rel_err / self.floor if self.floor > 0 else (1.0 if self.rel_err == 0 else math.inf)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "floor": self.floor, "excess": self.excess}


def measure(o: Any, ref: Any, dtype: torch.dtype, floor_cond: float = 0.0) -> Measurement:
    """Compare ``o`` (any dtype) with the float64 ``ref``; ``dtype`` is the output dtype the floor rounds to.

    Entries of ``ref`` beyond ``dtype``'s range must come back as the infinity they round to (a mismatch there
    counts as non-finite) and are left out of the errors and the rounding floor."""
    o, ref = _flat(o), _flat(ref)
    rounded = ref.to(dtype).to(torch.float64)
    overflow = torch.isinf(rounded) & torch.isfinite(ref)
    if bool(overflow.any()):
        mismatched = int((o[overflow] != rounded[overflow]).sum())
        o, ref = o[~overflow], ref[~overflow]
    else:
        mismatched = 0
    return Measurement(
        rel_err=rel_err(o, ref),
        max_err=max_err(o, ref),
        floor_round=rounding_floor(ref, dtype),
        floor_cond=floor_cond,
        nonfinite=nonfinite_count(o, ref) + mismatched,
        overflowed=int(overflow.sum()),
    )


def grade(figure: float, accuracy: float, correctness: float) -> str:
    """``held`` within ``accuracy``, ``imprecise`` up to ``correctness``, ``failed`` above it (or NaN)."""
    if figure <= accuracy:
        return HELD
    return IMPRECISE if figure <= correctness else FAILED


def verdict(m: Measurement, accuracy: float, correctness: float) -> str:
    """The verdict of a measurement: failed with any non-finite entry where the reference is finite, else its
    excess graded by the two bounds (:func:`grade`)."""
    return FAILED if m.nonfinite else grade(m.excess, accuracy, correctness)


def worst_verdict(verdicts: Any) -> str:
    """The worst of some verdicts (held when there are none)."""
    return max(verdicts, key=VERDICTS.index, default=HELD)


_USER_ACCURACY: contextvars.ContextVar[float | None] = contextvars.ContextVar("attnlab_user_accuracy", default=None)


def _checked(accuracy: float | None) -> float | None:
    if accuracy is not None and not (isinstance(accuracy, (int, float)) and math.isfinite(accuracy) and accuracy > 0):
        raise ValueError(f"a bound must be a positive number (a multiple of the floor); got {accuracy!r}")
    return accuracy


@contextlib.contextmanager
def user_bound(accuracy: float | None) -> Iterator[None]:
    """Within the block, verdicts hold outputs to ``accuracy`` (an excess, a multiple of the floor) in place of the
    registry's accuracy bound (None: the registry's); see :func:`user_bounds`."""
    token = _USER_ACCURACY.set(_checked(accuracy))
    try:
        yield
    finally:
        _USER_ACCURACY.reset(token)


def set_user_bound(accuracy: float | None) -> None:
    """:func:`user_bound` for the rest of the process (the pytest plugin's ``--attnlab-bound``)."""
    _USER_ACCURACY.set(_checked(accuracy))


def user_bounds(bounds: Bounds) -> Bounds:
    """``bounds`` (the registry's, attnlab.registry.bounds_for) with the accuracy bound replaced where
    :func:`user_bound` is in force; the correctness bound stays, raised to the user's bound where that is larger."""
    accuracy = _USER_ACCURACY.get()
    if accuracy is None:
        return bounds
    return replace(bounds, accuracy=accuracy, correctness=max(bounds.correctness, accuracy),
                   why=f"accuracy bound {accuracy:g} given by the user; " + bounds.why)


# ----------------------------------------------------------------------------- gradients (DESIGN.md, "Gradients")
#
# A gradient is measured as an output is: per gradient tensor, rel_err over the larger of its rounding floor (the
# float64 gradient rounded once to the dtype a kernel returns it in: its input's dtype, fp32 for the initial state)
# and its conditioning floor (the float64 gradient's relative change when the inputs and the cotangents are
# perturbed at fp32 roundoff); non-finite entries are counted on their own. Gate and beta gradients are sums of
# many signed terms that can cancel: the conditioning floor is what keeps their verdicts honest.


def _perturbed_nested(values: Mapping[str, Any], args: Mapping[str, Any], unit: float,
                      generator: torch.Generator) -> dict[str, Any]:
    """:func:`_perturbed`, reaching into tuples (a multi-part initial state or its cotangent) part by part."""
    moved = {}
    for name, value in values.items():
        if isinstance(value, (tuple, list)):
            moved[name] = tuple(_perturbed({name: part}, args, unit, generator)[name] for part in value)
        else:
            moved[name] = _perturbed({name: value}, args, unit, generator)[name]
    return moved


def gradient_conditioning_floor(
    gradients: Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, Any]],
    inputs: Mapping[str, Any],
    cotangents: Mapping[str, Any],
    *,
    trials: int = 3,
    unit: float = UNIT_ROUNDOFF[torch.float32],
    seed: int = 0,
    base: Mapping[str, Any] | None = None,
    args: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Per gradient, its largest relative change when inputs and cotangents are perturbed by ``unit``.

    ``gradients(inputs, cotangents)`` returns float64 gradients by name (attnlab.gradients.oracle_gradients);
    ``cotangents`` holds ``do`` and, if any, ``d_final_state``. Every floating tensor of both (the parts of a
    tuple too) becomes ``x * (1 + unit * r)``, ``r`` uniform in [-1, 1], in ``trials`` random directions;
    ``args`` (argument name -> spec.Arg) clamps a perturbed input into its argument's range. ``base``: the
    already computed ``gradients(inputs, cotangents)``, if any. Trials run one by one: gradients of inputs
    without a batch dimension (retnet's g, RWKV-4's w and u, aft's w) sum over the batch, so trials stacked
    along it could not be told apart.
    """
    args = args or {}
    if base is None:
        base = gradients(inputs, cotangents)
    generator = torch.Generator().manual_seed(seed)
    floor = dict.fromkeys(base, 0.0)
    for _ in range(trials):
        moved = gradients(_perturbed_nested(inputs, args, unit, generator), _perturbed_nested(cotangents, {}, unit, generator))
        for name, reference in base.items():
            floor[name] = max(floor[name], rel_err(moved[name], reference))
    return floor


def measure_gradients(
    grads: Mapping[str, Any],
    reference: Mapping[str, Any],
    dtypes: Mapping[str, torch.dtype],
    floor_cond: Mapping[str, float] | None = None,
) -> dict[str, Measurement]:
    """:func:`measure` per gradient: ``grads`` (any dtype) against the float64 ``reference``, each rounded to
    ``dtypes[name]`` (the dtype it is returned in) for its rounding floor, with ``floor_cond[name]``
    (:func:`gradient_conditioning_floor`; 0 when absent) for its conditioning floor. A tuple (a multi-part
    state's gradient) is measured as one tensor, as :func:`measure` does. Every reference gradient must have one
    in ``grads``."""
    missing = [name for name in reference if name not in grads]
    if missing:
        raise ValueError(f"no gradient given for {', '.join(missing)}; the reference has {', '.join(reference)}")
    floor_cond = floor_cond or {}
    return {name: measure(grads[name], ref, dtypes[name], floor_cond.get(name, 0.0)) for name, ref in reference.items()}
