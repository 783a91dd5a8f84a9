"""The declarative pieces a registry entry is made of (PyTorch's OpInfo is the model).

A :class:`Formulation` lists its tensor arguments (:class:`Arg`: symbolic
shape, role, valid range, default sampling distribution, whether it is
differentiable), its scalar options (:class:`Option`), its state
(:class:`StateSpec`), the facts the generic properties rest on (convexity,
shift invariance, bilinear logits, :class:`Reduction` to special cases), its
third-party peers and how they are called (:class:`Peer`,
:class:`Convention`), its accuracy bounds where they differ from the
registry's table (:class:`Bounds`), and where its oracle and kernel modules
live. Everything generic (validation, sampling, the oracle and kernel front
ends, properties, tests, reports, bench, campaigns, the CLI) is driven by
these entries and never branches on a formulation's name.

The contract they encode is docs/FORMULATIONS.md (``CONTRACT``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

FORMS = ("recurrent", "parallel", "chunkwise")
# Where users read the contract (argument names, shapes, conventions, bounds); error messages cite it.
CONTRACT = "docs/FORMULATIONS.md"

# What an argument is to the function: generic code (properties, strategies, conventions, reports) acts on roles.
ROLES = (
    "query",           # q: read against the state (or the keys)
    "key",             # k: written into the state, or a logit
    "value",           # v: what the output averages or reads
    "log_gate",        # natural-log decay, <= 0, decay exp(g)
    "decay_rate",      # RWKV-4's w >= 0, decay exp(-w)
    "write_strength",  # the delta rules' beta in [0, 2]
    "bias",            # an additive logit bias: aft's pairwise w, RWKV-4's current-token bonus u
)

Dims = Mapping[str, int]
Sampler = Callable[[Dims, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class Arg:
    """A tensor argument of a formulation.

    ``dims`` is its symbolic shape (``("B", "T", "H", "K")``); ``role`` is one
    of ``ROLES``; ``low`` and ``high`` bound every element inclusively;
    ``optional`` arguments may be ``None`` (``general``'s gates);
    ``differentiable`` arguments get a gradient in the backward pass (every
    tensor input of FORMULATIONS.md is).
    """

    name: str
    dims: tuple[str, ...]
    doc: str
    sample: Sampler
    role: str = ""
    low: float | None = None
    high: float | None = None
    optional: bool = False
    allow_neg_inf: bool = False
    differentiable: bool = True

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"argument {self.name!r}: role must be one of {', '.join(ROLES)}; got {self.role!r}")

    @property
    def range_text(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f">= {self.low:g}"
        if self.high is not None:
            return f"<= {self.high:g}"
        return "finite"


@dataclass(frozen=True)
class Option:
    """A non-tensor keyword argument (``scale``, ``causal``, ``feature_map``...)."""

    name: str
    default: Any
    doc: str
    kind: type = float
    choices: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class StateSpec:
    """The recurrent state: one or more named tensors.

    A single part is passed and returned as a tensor, several as a tuple in
    this order. ``empty`` is each part's value in the zero (initial) state;
    ``log_scale`` parts may hold ``-inf`` (RWKV-4's ``p``, log of zero).
    """

    parts: tuple[tuple[str, tuple[str, ...]], ...]
    empty: tuple[float, ...]
    log_scale: tuple[bool, ...] = ()
    # Plain words for each part, where a report names one (a kernel that does not carry it); default "the state".
    words: tuple[str, ...] = ()

    def describe(self, name: str) -> str:
        """Plain words for the part ``name``."""
        index = self.names.index(name)
        return self.words[index] if self.words else f"the state part {name}"

    def is_log_scale(self, index: int) -> bool:
        return bool(self.log_scale) and self.log_scale[index]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)

    def shapes(self, dims: Dims) -> list[tuple[int, ...]]:
        return [tuple(dims[d] for d in part_dims) for _, part_dims in self.parts]

    def zeros(self, dims: Dims, device: torch.device | str = "cpu") -> torch.Tensor | tuple[torch.Tensor, ...]:
        parts = tuple(
            torch.full(shape, value, dtype=torch.float64, device=device)
            for shape, value in zip(self.shapes(dims), self.empty)
        )
        return parts[0] if len(parts) == 1 else parts

    def split(self, state: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (state,) if isinstance(state, torch.Tensor) else tuple(state)

    def join(self, parts: tuple[Any, ...]) -> Any:
        return parts[0] if len(parts) == 1 else tuple(parts)


MAP_FAMILIES = ("gate", "delta", "shift")


@dataclass(frozen=True)
class StabilityMap:
    """A stability map a formulation takes part in (``attnlab map``, attnlab/stability.py).

    ``family`` names the two swept parameters and the theoretical boundary:
    ``"gate"`` (log-gate strength x T; the cumulative log decay of one chunk
    reaching the exp threshold), ``"delta"`` (key norm x beta; the line
    ``beta |k|^2 = 2``), ``"shift"`` (a constant added to the keys x dtype;
    the exp thresholds 11.09 fp16, 88.72 bf16 and fp32). ``args`` are the
    arguments the swept parameter acts on: the log gates; the keys then the
    write strength; the keys.
    """

    family: str
    args: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.family not in MAP_FAMILIES:
            raise ValueError(f"family must be one of {', '.join(MAP_FAMILIES)}; got {self.family!r}")


Tensors = dict[str, Any]


@dataclass(frozen=True)
class Reduction:
    """The formulation ``special`` is this entry's function on the inputs ``to_general`` builds.

    Declared on the general entry (``general`` lists gla, retnet and
    unnormalized identity-map linear_attn). ``to_general`` maps the special
    case's call (tensors and options, any dtype) to the general one's;
    ``special_options`` are the options the special case must be drawn with.
    """

    special: str
    to_general: Callable[[Tensors], Tensors]
    special_options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Bounds:
    """What a kernel's error is judged by, per output dtype, as multiples of the floor (attnlab.metrics).

    - ``accuracy``: the excess a kernel as good as one rounding of the exact answer stays within; above it,
      the verdict is "imprecise".
    - ``correctness``: above this excess the kernel computes something else (a wrong scale, a lost chunk);
      the verdict is "failed". Set from measurement, between the largest excess of correct
      lower-precision kernels and the smallest of the selftest's defects.
    - ``state``: relative error of an fp32 final state built from this dtype's intermediates.
    - ``default_inputs``: the accuracy bound on the registry's default inputs, where it is tighter than on any
      input (fp32: the conditioning floor's few random directions underestimate how ill-conditioned the
      adversarial inputs are, not the default ones); what attnlab's kernel tests hold its kernels to.
      None: the accuracy bound.
    - ``gradient_accuracy``, ``gradient_correctness``: the same two bounds for each gradient of the backward pass
      (excess of a gradient over the larger of its rounding floor in the dtype it is returned in and its
      conditioning floor, attnlab.metrics.measure_gradients). None: the forward's.
    """

    accuracy: float
    correctness: float
    state: float
    default_inputs: float | None = None
    why: str = ""
    gradient_accuracy: float | None = None
    gradient_correctness: float | None = None

    @property
    def on_default_inputs(self) -> float:
        return self.accuracy if self.default_inputs is None else self.default_inputs

    @property
    def gradients(self) -> tuple[float, float]:
        """``(accuracy, correctness)`` for gradients: the gradient bounds, each defaulting to the forward's."""
        accuracy = self.accuracy if self.gradient_accuracy is None else self.gradient_accuracy
        correctness = self.correctness if self.gradient_correctness is None else self.gradient_correctness
        return accuracy, max(correctness, accuracy)


@dataclass(frozen=True)
class Convention:
    """How a third-party kernel is called, relative to attnlab's convention (whose values are the defaults).

    - ``names``: attnlab argument or option -> the kernel's keyword (e.g. ``{"g": "g_gamma"}``).
    - ``positional``: attnlab arguments passed positionally, in this order.
    - ``derived``: attnlab arguments the kernel does not take because it computes
      them itself (fla's chunk_retention fixes retnet's g); validation must use
      the registry's default for them.
    - ``implied``: options the kernel does not take because it always computes
      with these values (``{"causal": True}``); another value is refused.
    - ``gates``: "log" (attnlab: ``g <= 0``) or "linear" (the decay factor ``exp(g)``).
    - ``scale``: "pass" passes attnlab's scale (resolved, never None); a number
      means the kernel takes none and always uses that one (``"rsqrt_K"``: ``K ** -0.5``).
    - ``layout``: "BTHD" (attnlab's ``[B, T, H, D]``) or "BHTD" (head-first, torch SDPA's): every argument
      and the output with both ``T`` and ``H`` among their dims are transposed on the way in and out.
    - ``state``: "KV" (attnlab's ``[B, H, K, V]``) or "VK" (transposed).
    - ``state_keyword``: the kernel's keyword for the initial state (None: it has none).
    - ``final_state_flag``: keyword asking for the final state (fla: output_final_state).
    - ``returns``: "attnlab" (o, or (o, state) when asked), "o" (always o) or
      "o_state" (always a tuple whose first item is o and second the state).
    - ``fixed``: keywords always passed.
    - ``arg_dtypes``: attnlab argument -> the dtype the kernel wants it in (fla's g_gamma: fp32).
    - ``feature_map_outside``: the kernel applies no feature map, so the adapter applies the
      formulation's ``feature_map`` option to the query and key roles first (in fp32, rounded back).
    - ``decay_rate_as_log``: a ``decay_rate`` argument is passed as its log (fla's RWKV-4: decay
      ``exp(-exp(w'))``).
    - ``stacked_state``: the state parts are passed and returned stacked as ``[B, parts, 1, C]`` (fla's RWKV-4).
    - ``state_dtype``: the dtype the kernel wants its initial state in (fla: fp32);
      None passes it as given.
    - ``carries``: which of attnlab's state parts the kernel's state holds, as
      rules ``(condition, parts)``; the condition is ``""`` (always) or
      ``"option=value"`` (e.g. fla's linear attention carries only ``S`` when
      ``normalize=False``, ``(S, z)`` when normalized); the first rule that
      applies wins, none: every part. Parts a kernel does not carry come back
      as ``None`` and are not passed in (the properties compare only the parts
      carried, and say so when a run needs one that is not).
    - ``part_unsqueeze``: part -> dimension where the kernel's tensor has an
      extra singleton dimension (fla's normalizer z is ``[B, 1, H, K]``).
    """

    name: str = "attnlab"
    names: Mapping[str, str] = field(default_factory=dict)
    positional: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()
    implied: Mapping[str, Any] = field(default_factory=dict)
    gates: str = "log"
    scale: Any = "pass"
    layout: str = "BTHD"
    state: str = "KV"
    state_keyword: str | None = "initial_state"
    final_state_flag: str | None = "return_state"
    returns: str = "attnlab"
    fixed: Mapping[str, Any] = field(default_factory=dict)
    arg_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    feature_map_outside: bool = False
    decay_rate_as_log: bool = False
    stacked_state: bool = False
    state_dtype: torch.dtype | None = None
    carries: tuple[tuple[str, tuple[str, ...]], ...] = ()
    part_unsqueeze: Mapping[str, int] = field(default_factory=dict)

    def carried(self, f: Formulation, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The names of ``f``'s state parts this kernel's state holds under ``options``."""
        assert f.state is not None
        for condition, parts in self.carries:
            if not condition:
                return tuple(parts)
            option, _, value = condition.partition("=")
            default = next((o.default for o in f.options if o.name == option), None)
            if str(options.get(option, default)) == value:
                return tuple(parts)
        return f.state.names

    def describe(self) -> str:
        """One line saying how this convention differs from attnlab's."""
        default = Convention()
        parts = [f"{k}={getattr(self, k)!r}" for k in self.__dataclass_fields__
                 if k != "name" and getattr(self, k) != getattr(default, k)]
        return f"{self.name}: " + (", ".join(parts) if parts else "attnlab's own")


@dataclass(frozen=True)
class Peer:
    """A third-party kernel of the formulation: where it lives and how it is called.

    ``library`` names the campaign target it belongs to (``"fla"``, ``"torch"``); ``function`` is
    ``module:attribute``; ``our_options`` are the options attnlab's kernel must use to compute the same
    function (fla's chunk_linear_attn: identity map, unnormalized); ``bench`` marks the peer that
    ``attnlab bench`` times attnlab's kernel against (at most one per formulation).
    """

    library: str
    function: str
    convention: Convention
    label: str = ""
    our_options: tuple[tuple[str, Any], ...] = ()
    bench: bool = False

    @property
    def attribute(self) -> str:
        return self.function.rpartition(":")[2]


def _default_dims(B: int, T: int, H: int, K: int, V: int) -> dict[str, int]:
    return {"B": B, "T": T, "H": H, "K": K, "V": V}


@dataclass(frozen=True)
class Formulation:
    """One registry entry: everything generic code needs to know about a formulation."""

    name: str
    title: str
    definition: str
    args: tuple[Arg, ...]
    options: tuple[Option, ...] = ()
    state: StateSpec | None = None
    forms: tuple[str, ...] = FORMS
    kernel_forms: tuple[str, ...] = ("chunkwise",)
    notes: str = ""
    # Options of the recurrent oracle that select the textbook algorithm, for the
    # reports' naive baselines (rwkv4: the exp(k) accumulation, stable=False).
    naive_options: tuple[tuple[str, Any], ...] = ()
    # Options of the oracle that exist for one form only (rwkv4's recurrent ``stable``).
    form_options: Mapping[str, tuple[Option, ...]] = field(default_factory=dict)
    stability: tuple[StabilityMap, ...] = ()
    dims_from_sizes: Callable[[int, int, int, int, int], dict[str, int]] = field(default=_default_dims)
    # --- the facts the generic properties rest on (FORMULATIONS.md, "Facts the properties rest on")
    # Each output is a convex combination of the values it reads: None never, () always, else when every
    # (option, value) pair holds (linear attention: the elu1 map, normalized).
    convex_when: tuple[tuple[str, Any], ...] | None = None
    # The output is linear in the query (o_t = S_t^T (scale q_t)), so <q, dq> = <o, do>: None never, () always, else
    # when every (option, value) pair holds (linear attention: identity map, unnormalized).
    linear_in_query_when: tuple[tuple[str, Any], ...] | None = None
    # Arguments to which one constant added everywhere leaves o unchanged (RWKV-4's and aft's keys).
    shift_invariant: tuple[str, ...] = ()
    # The exponent is scale q.k (softmax): large logits reach exp's overflow threshold.
    bilinear_logits: bool = False
    # Formulations that are this one on other inputs (declared on the general one).
    reductions: tuple[Reduction, ...] = ()
    # --- third-party kernels and how they are called
    peers: tuple[Peer, ...] = ()
    # --- bounds where they differ from the registry's table (attnlab.registry.BOUNDS), by dtype name
    bounds: Mapping[str, Bounds] = field(default_factory=dict)

    # --- lookups --------------------------------------------------------
    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def args_with_role(self, *roles: str) -> tuple[Arg, ...]:
        """The arguments whose role is among ``roles``, in declaration order."""
        return tuple(a for a in self.args if a.role in roles)

    def is_convex(self, options: Mapping[str, Any]) -> bool:
        """Whether each output is a convex combination of the values under ``options`` (defaults filled in)."""
        if self.convex_when is None:
            return False
        return all(options.get(name, self.option(name).default) == value for name, value in self.convex_when)

    def is_linear_in_query(self, options: Mapping[str, Any]) -> bool:
        """Whether the output is linear in the query under ``options`` (defaults filled in)."""
        if self.linear_in_query_when is None:
            return False
        return all(options.get(name, self.option(name).default) == value for name, value in self.linear_in_query_when)

    def peer(self, library: str, attribute: str) -> Peer:
        """The peer of ``library`` whose function's attribute is ``attribute`` (fla's "chunk_gla")."""
        for p in self.peers:
            if p.library == library and p.attribute == attribute:
                return p
        known = ", ".join(p.function for p in self.peers) or "none"
        raise KeyError(f"{self.name} has no {library} peer {attribute!r}; its peers: {known}")

    @property
    def bench_peer(self) -> Peer | None:
        return next((p for p in self.peers if p.bench), None)

    def arg(self, name: str) -> Arg:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no argument {name!r}")

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(f"{self.name} has no option {name!r}")

    @property
    def oracle_module(self) -> str:
        return f"attnlab.oracles.{self.name}"

    @property
    def kernel_module(self) -> str:
        return f"attnlab.kernels.{self.name}"

    # --- sampling ---------------------------------------------------------
    def sample(
        self, B: int = 1, T: int = 64, H: int = 2, K: int = 16, V: int = 16, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        """Draw the registry's default inputs: a dict of argument name -> float64 CPU tensor.

        Each argument is drawn from its own generator (seeded from ``seed`` and
        the argument's position), so changing one distribution leaves the others'
        draws unchanged. Options (scale, causal...) are left at their defaults.
        """
        dims = self.dims_from_sizes(B, T, H, K, V)
        out: dict[str, torch.Tensor] = {}
        for position, arg in enumerate(self.args):
            generator = torch.Generator().manual_seed(seed * 1009 + position)
            out[arg.name] = arg.sample(dims, generator).to(torch.float64)
        return out

    def default_scale(self, dims: Dims) -> float:
        """The ``scale`` used when the caller passes ``None`` (FORMULATIONS.md)."""
        option = self.option("scale")
        return float(option.default) if option.default is not None else math.pow(dims["K"], -0.5)
