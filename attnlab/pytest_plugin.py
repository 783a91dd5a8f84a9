"""The attnlab pytest plugin (entry point ``pytest11: attnlab``): run the property suites on any kernel.

    pytest --pyargs attnlab.properties --attnlab-formulation gla --attnlab-kernel mypkg.ops:my_gla \\
        [--attnlab-device cpu|cuda] [--attnlab-dtype float16|bfloat16|float32] [--attnlab-profile ci|dev|gpu|thorough]
        [--attnlab-strict] [--attnlab-bound X] [--attnlab-passes forward,backward]
        [--attnlab-convention attnlab|fla|peer|auto]

A kernel given with ``--attnlab-kernel MODULE:FUNCTION`` follows the attnlab
convention (attnlab.properties.targets) by default: it is called with the
formulation's inputs as keyword arguments (FORMULATIONS.md names) and
returns ``o``; the state properties run when its signature names
``initial_state`` and ``return_state``, the chunk-size property when it
names ``chunk_size``. ``--attnlab-convention`` means what ``attnlab validate
--convention`` means (attnlab.conventions.choose_convention): ``fla``
(flash-linear-attention 0.6.0's convention of the fla function of that name,
or the one its signature fits), ``peer`` (the convention the registry declares
for that MODULE:FUNCTION among the formulation's peers) or ``auto`` (detected
on small inputs against the oracle; the convention found is printed in the
header, and a failure's summary recalls that the detection may be what is
wrong); the kernel is then called through attnlab.conventions.adapt. A kernel
that cannot be called in the convention, or returns something else than it
says (a tuple where attnlab's convention returns ``o``), is a usage error; so
is one whose convention fixes the scale or an option, or derives an argument
itself (the suites draw those: ``attnlab validate`` fits its cases to such a
kernel). Without ``--attnlab-kernel`` the suites run on
attnlab's own kernels (those that exist) and oracles. pytest exits 0 when
every property holds and 1 when one fails; the failure report names the
property, the measured figure, its bound and the reproducing input.

Verdicts (attnlab.properties.checks): an error-measuring property is held
within the registry's accuracy bound, imprecise up to its correctness bound,
failed above it (or non-finite, or raised). A failed property fails its
test. An input the kernel declines (it raises NotImplementedError) is skipped
and another drawn; declining every input fails the test. An imprecise one passes with an ``ImpreciseWarning`` (in pytest's
warnings summary) unless ``--attnlab-strict`` is given, which fails it.
``--attnlab-bound X`` replaces the accuracy bound (a multiple of the floor)
for the dtype chosen with ``--attnlab-dtype``.

``--attnlab-passes`` picks the passes judged: ``forward`` (the output), ``backward`` (the gradients: one property per
(check, gradient), ``backward_matches_oracle[dq]``...) or both (the default; the backward properties run only when
the kernel is differentiable, i.e. its output requires grad when its inputs do). ``backward`` on a kernel that is
not differentiable is a usage error. A backward that raises fails its properties with the kernel's message.

A CUDA fault (an illegal memory access and the like) loses the CUDA context of its process: the property it struck
fails with the input that faulted, unshrunk ("CUDA FAULT"), and under pytest-xdist the worker then ends before its
next test, which xdist reports as crashed, while a fresh worker runs the rest. Without xdist the later properties
fail unrun ("NOT RUN"), naming the fault. ``pytest --lf`` runs them again.

Hypothesis profiles ``attnlab-ci`` (derandomized, bounded), ``attnlab-dev``,
``attnlab-gpu`` and ``attnlab-thorough`` are registered at import; one is
loaded (``--attnlab-profile``, else the ``HYPOTHESIS_PROFILE`` environment
variable, else ``gpu`` on a CUDA device, ``ci`` when ``CI`` is set, ``dev``
otherwise) only in sessions that run attnlab's suites or attnlab's own test
tree, and never over an explicit ``--hypothesis-profile``. Likewise the
``gpu`` marker skips tests only there, when no CUDA device is present.
Other projects' test runs are left alone.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

PROFILE_PREFIX = "attnlab-"
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
PROFILES: dict[str, dict[str, Any]] = {
    "ci": {"derandomize": True, "database": None, "max_examples": 25, "print_blob": True},
    "dev": {"max_examples": 50},
    "gpu": {"max_examples": 200},
    "thorough": {"max_examples": 2000},
}
DTYPE_NAMES = ("float16", "bfloat16", "float32")
# attnlab.conventions.CONVENTION_CHOICES, written out: the plugin loads in every pytest run, and imports torch and
# attnlab only when a session asks for attnlab's suites (tests/test_plugin.py checks the two agree).
CONVENTION_CHOICES = ("attnlab", "fla", "peer", "auto")
# attnlab.properties: beside this module once installed, at the repository's top level in a source tree.
_PROPERTIES_DIR = next(p for p in (Path(__file__).resolve().parent / "properties",
                                   Path(__file__).resolve().parent.parent / "properties") if p.is_dir())

for _name, _values in PROFILES.items():
    settings.register_profile(PROFILE_PREFIX + _name, deadline=None, suppress_health_check=_SLOW_OK, **_values)


@dataclass(frozen=True)
class Selection:
    """What the session tests: the formulation filter, the kernel spec, device, dtypes and profile name, and how
    it grades (strict: an imprecise result fails; bound: the user's accuracy bound, or None for the registry's)."""

    formulation: str | None
    kernel: str | None
    device: str
    dtype: str | None
    profile: str
    strict: bool = False
    bound: float | None = None
    passes: tuple[str, ...] | None = None  # None: forward and, where the kernel is differentiable, backward
    convention: str | None = None  # how --attnlab-kernel is called (attnlab.conventions.CONVENTION_CHOICES); None: attnlab

    @property
    def convention_or_default(self) -> str:
        return self.convention or "attnlab"

    @property
    def passes_or_default(self) -> tuple[str, ...]:
        return self.passes if self.passes is not None else ("forward", "backward")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnlab", "attnlab property suites (pytest --pyargs attnlab.properties)")
    group.addoption("--attnlab-formulation", metavar="NAME", default=None,
                    help="the formulation (FORMULATIONS.md name); required with --attnlab-kernel")
    group.addoption("--attnlab-kernel", metavar="MODULE:FUNCTION", default=None,
                    help="the kernel to test (attnlab convention); default: attnlab's own kernels")
    group.addoption("--attnlab-device", choices=("cpu", "cuda"), default=None,
                    help="where inputs live (default: cuda if available, else cpu)")
    group.addoption("--attnlab-dtype", choices=DTYPE_NAMES, default=None,
                    help="input dtype (default: float16 and float32 on cpu, bfloat16 and float16 on cuda)")
    group.addoption("--attnlab-profile", choices=tuple(PROFILES), default=None,
                    help="hypothesis profile attnlab-NAME (default: HYPOTHESIS_PROFILE, else gpu on cuda, ci under CI, dev)")
    group.addoption("--attnlab-strict", action="store_true", default=None,
                    help="fail a property that is imprecise (above the accuracy bound, within the correctness bound); "
                         "without it an imprecise result passes with a warning")
    group.addoption("--attnlab-bound", metavar="X", type=float, default=None,
                    help="accuracy bound (excess, a multiple of the floor) in place of the registry's, for the dtype "
                         "given with --attnlab-dtype")
    group.addoption("--attnlab-convention", choices=CONVENTION_CHOICES, default=None,
                    help="how --attnlab-kernel is called, as attnlab validate --convention: attnlab (default), fla, "
                         "peer (the registry's convention for this MODULE:FUNCTION) or auto (detected on small inputs)")
    group.addoption("--attnlab-passes", metavar="forward,backward", default=None,
                    help="passes to judge: forward, backward or both (default: both, backward where the kernel is "
                         "differentiable)")


def selection(config: pytest.Config) -> Selection:
    """The session's choices, with defaults resolved (works with the plugin disabled, too)."""
    import torch

    device = config.getoption("attnlab_device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    profile = (config.getoption("attnlab_profile", None) or os.environ.get("HYPOTHESIS_PROFILE", "").removeprefix(PROFILE_PREFIX)
               or ("gpu" if device == "cuda" else "ci" if os.environ.get("CI") else "dev"))
    return Selection(config.getoption("attnlab_formulation", None), config.getoption("attnlab_kernel", None),
                     device, config.getoption("attnlab_dtype", None), profile,
                     bool(config.getoption("attnlab_strict", None)), config.getoption("attnlab_bound", None),
                     parse_passes(config.getoption("attnlab_passes", None)), config.getoption("attnlab_convention", None))


def parse_passes(text: str | None) -> tuple[str, ...] | None:
    """``"forward,backward"`` -> ``("forward", "backward")``; None stays None; a ValueError names a bad pass."""
    if text is None:
        return None
    passes = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in passes if p not in ("forward", "backward")]
    if bad or not passes:
        raise ValueError(f"--attnlab-passes {text!r}: expected forward, backward or forward,backward")
    return passes


# The exit status of a pytest-xdist worker ended for a lost CUDA context (pytest_runtest_protocol).
LOST_CONTEXT_EXIT = 3


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """End a pytest-xdist worker whose CUDA context a property search lost before it runs another test: every CUDA
    call there would fail. xdist reports this test as crashed and runs the rest on a fresh worker."""
    suite = sys.modules.get("attnlab.properties.suite")  # no search ran in this process without it
    if suite is not None and suite.lost_context() is not None and hasattr(item.config, "workerinput"):  # xdist's
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(LOST_CONTEXT_EXIT)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "long_sequences: attnlab's kernel properties at long T (with gpu)")
    if not _options_given(config):
        return
    try:
        chosen = selection(config)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    if chosen.profile not in PROFILES:
        raise pytest.UsageError(f"HYPOTHESIS_PROFILE={chosen.profile!r}: expected one of {', '.join(PROFILES)}")
    from attnlab.registry import names

    if chosen.formulation is not None and chosen.formulation not in names():
        raise pytest.UsageError(f"--attnlab-formulation {chosen.formulation!r}: expected one of {', '.join(names())}")
    if chosen.convention is not None and chosen.kernel is None:
        raise pytest.UsageError(f"--attnlab-convention {chosen.convention} needs --attnlab-kernel MODULE:FUNCTION "
                                "(attnlab's own kernels follow attnlab's convention)")
    if chosen.kernel is not None:
        if chosen.formulation is None:
            raise pytest.UsageError("--attnlab-kernel needs --attnlab-formulation NAME (which function the kernel computes)")
        target = _resolve_kernel(config, chosen)
        if chosen.passes is not None and "backward" in chosen.passes and not target.differentiable:
            raise pytest.UsageError(f"--attnlab-passes backward: {chosen.kernel} is not differentiable (called on "
                                    "inputs that require grad, its output does not require grad); judge its forward "
                                    "with --attnlab-passes forward")
    if chosen.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--attnlab-device cuda: no CUDA device is available")
    if chosen.bound is not None:
        import math

        if not (math.isfinite(chosen.bound) and chosen.bound > 0):
            raise pytest.UsageError(f"--attnlab-bound {chosen.bound:g}: expected a positive multiple of the floor")
        if chosen.dtype is None:
            raise pytest.UsageError("--attnlab-bound needs --attnlab-dtype: a bound (a multiple of the floor) "
                                    "belongs to one dtype")
    from attnlab.properties import checks, suite

    suite.POLICY.strict = chosen.strict
    checks.set_user_bound(chosen.bound)


# The session's --attnlab-kernel, resolved in its convention (attnlab.properties.targets.Resolved), once.
RESOLVED = pytest.StashKey[Any]()
SMOKE_SIZES = dict(B=1, T=4, H=1, K=16, V=16)


def default_dtypes(device: str) -> tuple[str, ...]:
    """The dtypes the suites run in when --attnlab-dtype is not given."""
    return ("bfloat16", "float16") if device == "cuda" else ("float16", "float32")


def _resolve_kernel(config: pytest.Config, chosen: Selection) -> Any:
    """The --attnlab-kernel target in --attnlab-convention (detected on the session's first dtype under auto), after
    one call on small inputs: a kernel that cannot be called so, or returns something else than the convention says,
    is a usage error."""
    import torch

    from attnlab.evaluate import parse_dtype
    from attnlab.properties.targets import resolve_in_convention, smoke_check
    from attnlab.registry import formulation

    if chosen.device == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--attnlab-device cuda: no CUDA device is available")
    dtype = parse_dtype(chosen.dtype or default_dtypes(chosen.device)[0])
    try:
        resolved = resolve_in_convention(chosen.kernel, chosen.formulation, chosen.convention_or_default, dtype=dtype,
                                         device=chosen.device)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    if resolved.target is None:
        raise pytest.UsageError(resolved.detection_text)
    convention = resolved.convention
    f = formulation(chosen.formulation)
    fixed = [what for what, present in (
        (f"scale={convention.scale}", "scale" in f.option_names and convention.scale != "pass"),
        (", ".join(f"{k}={v!r}" for k, v in convention.implied.items()), bool(convention.implied)),
        (f"{', '.join(convention.derived)} computed by the kernel itself", bool(convention.derived))) if present]
    if fixed:
        # The suites draw every scale, option and argument; attnlab validate fits its cases to such a kernel.
        raise pytest.UsageError(f"{chosen.kernel} in convention {convention.name} always computes with "
                                f"{'; '.join(fixed)}: the plugin's suites draw other values, so judge it with "
                                f"attnlab validate --formulation {f.name} --kernel {chosen.kernel} --convention "
                                f"{chosen.convention_or_default}, which draws its cases to fit the kernel")
    inputs: dict[str, Any] = {n: t.to(device=chosen.device, dtype=dtype) for n, t in f.sample(**SMOKE_SIZES, seed=0).items()}
    try:
        smoke_check(resolved.target, inputs, convention,
                    hint="pass --attnlab-convention fla, peer or auto (attnlab validate --convention auto finds it too)")
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    config.stash[RESOLVED] = resolved
    return resolved.target


def _options_given(config: pytest.Config) -> bool:
    return any(config.getoption(f"attnlab_{o}", None) is not None
               for o in ("formulation", "kernel", "device", "dtype", "profile", "strict", "bound", "passes", "convention"))


def _own_tree(config: pytest.Config) -> bool:
    """Whether this session runs in attnlab's own source tree (its test suite)."""
    return (config.rootpath / "attnlab" / "pytest_plugin.py").resolve() == Path(__file__).resolve()


def _in_scope(config: pytest.Config, item: pytest.Item) -> bool:
    return _own_tree(config) or _PROPERTIES_DIR in Path(str(item.path)).resolve().parents


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not (_own_tree(config) or _options_given(config) or any("attnlab.properties" in a for a in config.args)):
        return None
    chosen = selection(config)
    resolved = config.stash.get(RESOLVED, None)
    lines = [_header(chosen)]
    if resolved is not None and resolved.detection is not None:
        lines.append(f"attnlab: {resolved.detection_text}")
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Under --attnlab-convention auto: the convention found (the header says it too, unless -q hides it), and, when a
    test failed, that the failure may be the detection's."""
    resolved = config.stash.get(RESOLVED, None)
    if resolved is None or resolved.detection is None:
        return
    from attnlab.conventions import detection_caveat

    terminalreporter.write_line(f"attnlab: {resolved.detection_text}")
    if terminalreporter.stats.get("failed"):
        terminalreporter.write_line(f"attnlab: {detection_caveat('--attnlab-convention')}")


def _header(chosen: Selection) -> str:
    return (f"attnlab: formulation={chosen.formulation or 'all'} kernel={chosen.kernel or 'attnlab'} "
            f"convention={chosen.convention_or_default} "
            f"device={chosen.device} dtype={chosen.dtype or 'default'} profile={PROFILE_PREFIX + chosen.profile} "
            f"strict={'yes' if chosen.strict else 'no'} "
            f"bound={'registry' if chosen.bound is None else f'{chosen.bound:g}'} "
            f"passes={','.join(chosen.passes_or_default)} "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scoped = [item for item in items if _in_scope(config, item)]
    if not scoped:
        return
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile(PROFILE_PREFIX + selection(config).profile)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in scoped:
        if "gpu" in item.keywords:
            item.add_marker(skip)
