"""The backward pass judged (issue 22): gradient bounds, differentiable targets, the gradient properties, the suite's
passes, ``attnlab validate --passes`` and the plugin's ``--attnlab-passes``, on small CPU kernels in plain torch.

The kernels: the float64 oracle rounded once (the ideal), the fp32 oracle (a correct kernel), and kernels whose
forward is right and whose backward is wrong (dq without its scale, a dv that sees an earlier position's do, dq
doubled), refuses (raises NotImplementedError, as fla's gated ops do on Hopper), gives no gradient, or one of the
wrong shape.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.commands.validate import EXIT_FAILED, EXIT_HELD, EXIT_USAGE, make_target
from attnlab.conventions import FLA
from attnlab.properties import checks, suite
from attnlab.properties.strategies import Case
from attnlab.properties.targets import Target, function_target, own_kernel_target, rounded_oracle_target
from attnlab.registry import BOUNDS, REGISTRY, formulation

KERNELS = '''
"""Differentiable GLA kernels in attnlab's convention: the fp32 oracle, and forwards right with backwards wrong."""
import torch
import attnlab

_FP32 = attnlab.oracle("gla", "chunkwise", "float32", chunk_size=16)


def good(q, k, v, g, scale=None, initial_state=None, return_state=False):
    """Correct: the oracle computed in fp32, rounded to the input dtype (autograd gives its backward)."""
    out = _FP32(q=q.float(), k=k.float(), v=v.float(), g=g.float(), scale=scale,
                initial_state=None if initial_state is None else initial_state.float(), return_state=return_state)
    return (out[0].to(q.dtype), out[1]) if return_state else out.to(q.dtype)


def detached_state(q, k, v, g, scale=None, initial_state=None, return_state=False):
    """Broken backward: the returned state is detached, so no gradient flows back through a resumed run."""
    out = good(q, k, v, g, scale, initial_state, return_state)
    return (out[0], out[1].detach()) if return_state else out


class _EditedBackward(torch.autograd.Function):
    """good's forward; its backward is good's, edited by ``edit(leaves, do, scale)`` (q, k, v, g gradients)."""

    @staticmethod
    def forward(ctx, edit, scale, q, k, v, g):
        ctx.edit, ctx.scale = edit, scale
        ctx.save_for_backward(q, k, v, g)
        return good(q, k, v, g, scale)

    @staticmethod
    def backward(ctx, do):
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            grads = ctx.edit(leaves, do, ctx.scale)
        return (None, None, *grads)


def _grads(leaves, do, scale):
    return list(torch.autograd.grad(good(*leaves, scale=scale), leaves, do))


def _unscaled_dq(leaves, do, scale):
    grads = _grads(leaves, do, scale)
    grads[0] = grads[0] / (leaves[0].shape[-1] ** -0.5 if scale is None else scale)  # dq without its scale
    return grads


def _stale_dv(leaves, do, scale):
    grads = _grads(leaves, do, scale)
    earlier = torch.cat([torch.zeros_like(do[:, :1]), do[:, :-1]], dim=1)  # dv_t sees position t-1's do
    grads[2] = torch.autograd.grad(good(*leaves, scale=scale), leaves[2], earlier)[0]
    return grads


def _doubled_dq(leaves, do, scale):
    grads = _grads(leaves, do, scale)
    grads[0] = 2 * grads[0]
    return grads


def _no_dg(leaves, do, scale):
    return _grads(leaves, do, scale)[:3] + [None]


def _wrong_shape_dk(leaves, do, scale):
    grads = _grads(leaves, do, scale)
    grads[1] = grads[1][:, :1]
    return grads


class _Refuse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, q, k, v, g):
        return good(q, k, v, g, scale)

    @staticmethod
    def backward(ctx, do):
        raise NotImplementedError("backward is not supported on this GPU with Triton < 3.7.1 (a stand-in)")


def unscaled_dq(q, k, v, g, scale=None):
    return _EditedBackward.apply(_unscaled_dq, scale, q, k, v, g)


def stale_dv(q, k, v, g, scale=None):
    return _EditedBackward.apply(_stale_dv, scale, q, k, v, g)


def doubled_dq(q, k, v, g, scale=None):
    return _EditedBackward.apply(_doubled_dq, scale, q, k, v, g)


def no_dg(q, k, v, g, scale=None):
    return _EditedBackward.apply(_no_dg, scale, q, k, v, g)


def wrong_shape_dk(q, k, v, g, scale=None):
    return _EditedBackward.apply(_wrong_shape_dk, scale, q, k, v, g)


def refuses(q, k, v, g, scale=None):
    return _Refuse.apply(scale, q, k, v, g)


def forward_only(q, k, v, g, scale=None):
    with torch.no_grad():
        return good(q, k, v, g, scale)
'''

SMALL = dict(B=1, T=7, H=2, K=5, V=4)
FAST = ["--device", "cpu", "--examples", "3", "--no-progress", "--strategy", "default", "--lengths", "none",
        "--max-T", "20", "--dims", "8"]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("gradkernels")
    (folder / "gradkernels.py").write_text(textwrap.dedent(KERNELS))
    sys.path.insert(0, str(folder))
    try:
        import gradkernels  # noqa: PLC0415

        gradkernels.folder = folder
        yield gradkernels
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("gradkernels", None)


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["validate", *argv])
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def rows(stdout: str) -> dict[tuple[str, str], str]:
    """The verdict table's lines by (dtype, property)."""
    found = {}
    for line in stdout.splitlines():
        cells = line.split()
        if len(cells) >= 4 and cells[0] in ("default", "adversarial"):
            found[(cells[1], cells[2])] = line
    return found


# ----------------------------------------------------------------------------- bounds and the entry's facts


def test_gradient_bounds_are_in_the_one_table_with_their_reason() -> None:
    assert BOUNDS["bfloat16"].gradients == (1.5, 8.0)
    assert BOUNDS["float16"].gradients == (2.0, 16.0)
    assert BOUNDS["float32"].gradients == (BOUNDS["float32"].accuracy, BOUNDS["float32"].correctness)
    for dtype, b in BOUNDS.items():
        assert "gradients:" in b.why and "conditioning floor" in b.why
    # Unset, they default to the forward's.
    assert replace(BOUNDS["float16"], gradient_accuracy=None, gradient_correctness=None).gradients == (2.0, 16.0)
    assert checks.gradient_bounds("gla", torch.float16) == (2.0, 16.0)
    with checks.user_bound(3.0):
        assert checks.gradient_bounds("gla", torch.float16) == (3.0, 16.0)


def test_which_outputs_are_linear_in_the_query_is_declared_on_the_entry() -> None:
    linear = {f.name for f in REGISTRY if f.is_linear_in_query({})}
    assert linear == {"retnet", "gla", "general", "deltanet", "gated_deltanet", "kda"}
    f = formulation("linear_attn")
    assert f.is_linear_in_query({"feature_map": "identity", "normalize": False})
    assert not f.is_linear_in_query({"feature_map": "identity", "normalize": True})
    assert formulation("softmax").linear_in_query_when is None


# ----------------------------------------------------------------------------- differentiable targets


def test_a_target_is_differentiable_when_its_output_requires_grad(kernels: Any) -> None:
    assert rounded_oracle_target("gla").differentiable
    assert function_target(kernels.good, "gla", "good").differentiable
    assert not function_target(kernels.forward_only, "gla", "forward_only").differentiable
    assert own_kernel_target("gla", "chunkwise").differentiable  # declared by its module's BACKWARD
    assert own_kernel_target("kda", "chunkwise").differentiable
    calls = []

    def counted(**x: Any) -> Any:
        calls.append(1)
        return kernels.good(**x)

    target = function_target(counted, "gla", "counted")
    assert target.differentiable and target.differentiable and len(calls) == 1  # probed once

    def tiled(q, k, v, g, scale=None):  # noqa: ANN001, ANN202 - like a Triton kernel that wants K >= 16
        if q.shape[-1] < 16:
            raise ValueError("K must be at least 16")
        return kernels.good(q, k, v, g, scale)

    assert function_target(tiled, "gla", "tiled").differentiable  # the probe tries larger head dims

    def broken(**x: Any) -> Any:
        raise RuntimeError("no kernel image")

    assert not function_target(broken, "gla", "broken").differentiable
    from attnlab.properties.targets import PROBE_NOTES

    assert "raised on every probe input (RuntimeError: no kernel image)" in PROBE_NOTES["broken"]


def test_the_suite_adds_one_backward_property_per_check_and_gradient(kernels: Any) -> None:
    good = function_target(kernels.good, "gla", "good")
    forward = [p.name for p in suite.applicable(good)]
    assert forward == [p.name for p in suite.applicable(good, ("forward",))] and not any("[" in n for n in forward)
    both = [p.name for p in suite.applicable(good, ("forward", "backward"))]
    backward = [p.name for p in suite.applicable(good, ("backward",))]
    assert both == forward + backward
    assert backward[:5] == [f"backward_matches_oracle[d{n}]" for n in ("q", "k", "v", "g", "initial_state")]
    assert "backward_query_identity[dq]" in backward and "backward_split_and_resume[dg]" in backward
    assert "backward_causality[dinitial_state]" not in backward
    assert not suite.applicable(function_target(kernels.forward_only, "gla", "f"), ("backward",))
    assert "backward_shift_identity[dk]" in [p.name for p in suite.applicable(rounded_oracle_target("rwkv4"), ("backward",))]
    softmax = [p.name for p in suite.applicable(rounded_oracle_target("softmax"), ("backward",))]
    assert not any("query_identity" in n for n in softmax) and "backward_shift_identity[dk]" in softmax
    with pytest.raises(ValueError, match="passes must be among forward, backward"):
        suite.applicable(good, ("sideways",))


# ----------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("name", [f.name for f in REGISTRY])
def test_every_backward_property_holds_on_the_ideal_kernel(name: str) -> None:
    target = rounded_oracle_target(name)
    options = formulation(name).linear_in_query_when or ()
    case = Case(name=name, seed=11, cut=3, options=options, **SMALL)
    for prop in suite.backward_properties(target):
        result = prop.check(target, case, torch.float16, "cpu")
        assert result.held, result.message()


def _check(kernels: Any, kernel: str, prop: str, gradient: str, dtype: torch.dtype = torch.float16,
           **case: Any) -> checks.CheckResult:
    target = function_target(getattr(kernels, kernel), "gla", f"gradkernels:{kernel}")
    chosen = Case(name="gla", seed=4, **{**SMALL, "cut": 3, **case})
    return checks.BACKWARD_CHECKS[prop](target, chosen, dtype, "cpu", gradient=gradient)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_broken_backwards_are_caught_by_the_gradient_they_break(kernels: Any, dtype: torch.dtype) -> None:
    for gradient in ("dq", "dk", "dv", "dg", "dinitial_state"):
        assert _check(kernels, "good", "backward_matches_oracle", gradient, dtype).held
    unscaled = _check(kernels, "unscaled_dq", "backward_matches_oracle", "dq", dtype)
    assert unscaled.failed and unscaled.figure > unscaled.correctness and "dq: rel_err" in unscaled.detail
    assert _check(kernels, "unscaled_dq", "backward_matches_oracle", "dk", dtype).held
    assert _check(kernels, "unscaled_dq", "backward_query_identity", "dq", dtype).failed  # oracle-free
    assert _check(kernels, "good", "backward_query_identity", "dq", dtype).held
    stale = _check(kernels, "stale_dv", "backward_causality", "dv", dtype)
    assert stale.failed and "not exactly zero" in stale.detail
    assert _check(kernels, "stale_dv", "backward_causality", "dq", dtype).held
    assert _check(kernels, "stale_dv", "backward_matches_oracle", "dv", dtype).failed
    detached = _check(kernels, "detached_state", "backward_split_and_resume", "dk", dtype)
    assert detached.failed and _check(kernels, "good", "backward_split_and_resume", "dk", dtype).held


def test_a_state_part_the_options_leave_unused_may_come_back_without_a_gradient() -> None:
    # fla's linear attention without normalize carries S alone: the normalizer z of attnlab's (S, z) state gets no
    # gradient and no final-state cotangent, and its exact gradient is zero. Seen on the GPU as a false failure.
    ideal = rounded_oracle_target("linear_attn")

    def s_only(*, initial_state=None, return_state=False, **x: Any) -> Any:
        if initial_state is not None:
            initial_state = (initial_state[0], initial_state[1].detach())
        o, final = ideal.function(**x, initial_state=initial_state, return_state=True)
        return (o, (final[0], None)) if return_state else o

    target = function_target(s_only, "linear_attn", "s_only")
    plain = Case(name="linear_attn", seed=4, **SMALL, options=(("feature_map", "elu1"), ("normalize", False)))
    result = checks.BACKWARD_CHECKS["backward_matches_oracle"](target, plain, torch.float16, "cpu",
                                                               gradient="dinitial_state")
    assert result.held, result.message()
    normalized = replace(plain, options=(("feature_map", "elu1"), ("normalize", True)))
    missing = checks.BACKWARD_CHECKS["backward_matches_oracle"](target, normalized, torch.float16, "cpu",
                                                                gradient="dinitial_state")
    assert missing.failed and "returned no gradient for initial_state" in missing.detail  # z is read: a real miss


def test_an_input_without_a_time_axis_that_the_resumed_call_ignores_is_judged_not_a_crash() -> None:
    # RWKV-4's u has one leaf per call of split-and-resume and one reference part: the resumed call detaching it
    # used to index a second reference part that does not exist. Its gradient then misses the tail's share: failed.
    ideal = rounded_oracle_target("rwkv4")

    def tail_ignores_u(*, initial_state=None, return_state=False, **x: Any) -> Any:
        if initial_state is not None:
            x = {**x, "u": x["u"].detach()}
        return ideal.function(**x, initial_state=initial_state, return_state=return_state)

    target = function_target(tail_ignores_u, "rwkv4", "tail_ignores_u")
    case = Case(name="rwkv4", seed=4, B=1, T=6, H=1, K=4, V=4, cut=3)
    result = checks.BACKWARD_CHECKS["backward_split_and_resume"](target, case, torch.float32, "cpu", gradient="du")
    assert result.failed and "du" in result.detail, result.message()
    whole = checks.BACKWARD_CHECKS["backward_split_and_resume"](ideal, case, torch.float32, "cpu", gradient="du")
    assert whole.held, whole.message()


@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
def test_a_gradient_that_is_zero_up_to_float64_rounding_is_not_judged_relative_to_that_noise(form: str) -> None:
    # Found by CI's search on attnlab's kernels: normalized linear attention at K = 1 does not depend on q (phi(q)
    # cancels), so the exact dq is zero; the float64 reference is rounding noise (1e-17) and the kernel's fp32 noise
    # read as an excess of 1e8.
    target = own_kernel_target("linear_attn", form)
    case = Case(name="linear_attn", seed=1, B=1, T=2, H=1, K=1, V=1, cut=1,
                options=(("feature_map", "identity"), ("normalize", True)))
    for prop in ("backward_matches_oracle", "backward_split_and_resume"):
        result = checks.BACKWARD_CHECKS[prop](target, case, torch.float32, "cpu", gradient="dq")
        assert result.held and "zero up to float64 rounding" in result.detail, result.message()
    dk = checks.BACKWARD_CHECKS["backward_matches_oracle"](target, case, torch.float32, "cpu", gradient="dk")
    assert dk.held and dk.figure > 0  # a gradient that is not zero is still measured


def test_a_backward_that_raises_or_gives_a_bad_gradient_is_failed_with_its_message(kernels: Any) -> None:
    refused = _check(kernels, "refuses", "backward_matches_oracle", "dq")
    assert refused.failed and refused.measure == checks.BACKWARD_RAISED
    assert "NotImplementedError: backward is not supported" in refused.detail and "REFUSED" in refused.message()
    missing = _check(kernels, "no_dg", "backward_matches_oracle", "dg")
    assert missing.failed and "returned no gradient for g" in missing.detail
    assert _check(kernels, "no_dg", "backward_matches_oracle", "dq").held
    shape = _check(kernels, "wrong_shape_dk", "backward_finite", "dk")
    assert shape.failed and shape.measure != checks.BACKWARD_RAISED and "invalid gradient" in shape.detail
    not_differentiable = _check(kernels, "forward_only", "backward_matches_oracle", "dq")
    assert not_differentiable.failed and "does not require grad" in not_differentiable.detail


@pytest.mark.parametrize("name", [f.name for f in REGISTRY if any(checks.keys_shift_invariant(f, a.name) for a in f.args)])
def test_the_shift_identity_catches_a_dk_that_does_not_sum_to_zero(name: str) -> None:
    ideal = rounded_oracle_target(name)

    class ShiftedDk(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, k: torch.Tensor) -> torch.Tensor:
            return k.clone()

        @staticmethod
        def backward(ctx: Any, dk: torch.Tensor) -> torch.Tensor:
            return dk + 0.05 * dk.abs().max()

    broken = Target(f"{name} dk shifted", name, lambda **x: ideal(**{**x, "k": ShiftedDk.apply(x["k"])}), False)
    case = Case(name=name, seed=2, **SMALL)
    assert checks.check_backward_shift_identity(ideal, case, torch.float16, gradient="dk").held
    result = checks.check_backward_shift_identity(broken, case, torch.float16, gradient="dk")
    assert result.failed and "sum_t dk_t" in result.measure


def test_gradients_are_invariant_to_the_chunk_size_of_a_correct_kernel() -> None:
    def chunked(q, k, v, g, scale=None, chunk_size=16):  # noqa: ANN001, ANN202
        return attnlab.oracle("gla", "chunkwise", "float32", chunk_size=chunk_size)(q=q, k=k, v=v, g=g, scale=scale)

    target = function_target(chunked, "gla", "chunked")
    assert len(target.chunk_sizes) >= 2
    case = Case(name="gla", seed=3, B=1, T=40, H=1, K=4, V=4)
    for gradient in ("dq", "dg"):
        result = checks.check_backward_chunk_size_invariance(target, case, torch.float32, gradient=gradient)
        assert result.held, result.message()


def test_gradients_map_through_a_convention_adapter() -> None:
    """A kernel in fla's convention taking linear gates (the decay factor exp(g)): the adapter's conversion is a torch
    op, so dg comes back in attnlab's log-gate terms and matches the oracle."""
    def linear_gates(q, k, v, g, scale=None, initial_state=None, output_final_state=False):  # noqa: ANN001, ANN202
        o, state = attnlab.oracle("gla", "recurrent", "float32")(
            q=q.float(), k=k.float(), v=v.float(), g=torch.log(g.float()), scale=scale,
            initial_state=None if initial_state is None else initial_state.float(), return_state=True)
        return o.to(q.dtype), (state if output_final_state else None)

    convention = replace(FLA["gla"]["chunk_gla"], gates="linear")
    target = make_target(linear_gates, "gla", "fla-style linear gates", convention)
    assert target.differentiable and target.accepts_state
    case = Case(name="gla", seed=6, gate_low=-3.0, **SMALL)
    for gradient in ("dg", "dq", "dinitial_state"):
        result = checks.check_backward_matches_oracle(target, case, torch.float32, gradient=gradient)
        assert result.held, result.message()


# ----------------------------------------------------------------------------- attnlab validate --passes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_validate_holds_a_correct_backward_with_one_row_per_gradient(kernels: Any, tmp_path: Path, dtype: str) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run("--formulation", "gla", "--kernel", f"{kernels.folder}/gradkernels.py:good",
                               "--dtype", dtype, "--out", str(out), *FAST)
    assert code == EXIT_HELD, stdout + stderr
    assert "passes: forward, backward (the kernel is differentiable)" in stdout
    table = rows(stdout)
    for gradient in ("dq", "dk", "dv", "dg", "dinitial_state"):
        assert (dtype, f"backward_matches_oracle[{gradient}]") in table
    assert (dtype, "matches_oracle") in table and (dtype, "backward_query_identity[dq]") in table
    assert not any(" FAILED " in line for line in table.values())
    data = json.loads((out / "report.json").read_text())
    assert data["passes"] == ["forward", "backward"] and data["differentiable"] is True
    rows_of = {(r["pass"], r["property"], r["gradient"]) for r in data["verdicts"]}
    assert ("forward", "matches_oracle", None) in rows_of
    assert ("backward", "backward_matches_oracle[dg]", "dg") in rows_of


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel, broken", [("unscaled_dq", ["backward_matches_oracle[dq]", "backward_query_identity[dq]"]),
                                            ("stale_dv", ["backward_matches_oracle[dv]", "backward_causality[dv]"])])
def test_validate_fails_a_broken_backward_with_a_reproducing_case(kernels: Any, tmp_path: Path, dtype: str,
                                                                  kernel: str, broken: list[str]) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run("--formulation", "gla", "--kernel", f"{kernels.folder}/gradkernels.py:{kernel}",
                               "--dtype", dtype, "--passes", "backward", "--out", str(out), *FAST)
    assert code == EXIT_FAILED, stdout + stderr
    table = rows(stdout)
    assert not any(p == "matches_oracle" for _, p in table)  # backward only
    for prop in broken:
        assert " FAILED " in table[(dtype, prop)], stdout
    assert " held " in table[(dtype, "backward_matches_oracle[dk]")]
    data = json.loads((out / "report.json").read_text())
    script = data["repro"][f"default/{dtype}/{broken[0]}"]
    assert f"gradient={broken[0].split('[')[1][:-1]!r}" in script
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(script, "repro.py", "exec"), {"__name__": "repro"})  # noqa: S102
    assert f"property {broken[0]} FAILED" in printed.getvalue()


def test_validate_reports_a_refused_backward_and_exits_1(kernels: Any) -> None:
    code, stdout, stderr = run("--formulation", "gla", "--kernel", f"{kernels.folder}/gradkernels.py:refuses",
                               "--dtype", "float32", "--properties", "matches_oracle,backward_matches_oracle", *FAST)
    assert code == EXIT_FAILED, stdout + stderr
    table = rows(stdout)
    assert " held " in table[("float32", "matches_oracle")]
    line = table[("float32", "backward_matches_oracle[dq]")]
    assert " REFUSED " in line and "NotImplementedError: backward is not supported" in line
    assert "refused (the backward raised, or every input was declined)" in stdout and "Traceback" not in stdout + stderr


def test_validate_passes_usage(kernels: Any) -> None:
    spec = f"{kernels.folder}/gradkernels.py:forward_only"
    code, stdout, stderr = run("--formulation", "gla", "--kernel", spec, "--dtype", "float32", "--passes", "backward",
                               *FAST)
    assert code == EXIT_USAGE and "is not differentiable" in stderr and "--passes forward" in stderr
    code, stdout, _ = run("--formulation", "gla", "--kernel", spec, "--dtype", "float32",
                          "--properties", "matches_oracle", *FAST)
    assert code == EXIT_HELD and "passes: forward (the kernel is not differentiable)" in stdout
    code, _, stderr = run("--formulation", "gla", "--kernel", spec, "--passes", "sideways", *FAST)
    assert code == EXIT_USAGE and "--passes must be forward, backward" in stderr


# ----------------------------------------------------------------------------- the plugin's --attnlab-passes


def _plugin(folder: Path, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "--pyargs", "attnlab.properties", "-q", "-p", "no:cacheprovider",
               "--attnlab-profile", "ci", "--attnlab-device", "cpu", "--attnlab-formulation", "gla",
               "--attnlab-dtype", "float32", *options]
    env = {**os.environ, "PYTHONPATH": str(folder)}
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)


def test_the_plugin_judges_a_backward_as_a_user_meets_it(kernels: Any) -> None:
    select = ("-k", "backward_matches_oracle and not initial_state and not dv and not dg")  # dq and dk
    good = _plugin(kernels.folder, "--attnlab-kernel", "gradkernels:good", *select, "-rA")
    assert good.returncode == 0, good.stdout[-4000:] + good.stderr[-2000:]
    assert "backward_matches_oracle[dq]-gradkernels:good-float32" in good.stdout and "2 passed" in good.stdout
    broken = _plugin(kernels.folder, "--attnlab-kernel", "gradkernels:doubled_dq", "--attnlab-passes", "backward",
                     *select)
    assert broken.returncode == 1, broken.stdout[-4000:] + broken.stderr[-2000:]
    assert "property backward_matches_oracle[dq] FAILED for gradkernels:doubled_dq" in broken.stdout
    assert "1 failed, 1 passed" in broken.stdout
    usage = _plugin(kernels.folder, "--attnlab-kernel", "gradkernels:forward_only", "--attnlab-passes", "backward")
    assert usage.returncode == 4 and "is not differentiable" in usage.stderr


def test_an_argument_the_kernel_derives_gets_no_gradient_row() -> None:
    """fla's chunk_retention computes retnet's g itself: validate judges dq, dk, dv and the state's gradient only."""
    from attnlab.commands.validate import properties_for

    def retention(q, k, v, scale=None, initial_state=None, output_final_state=False):  # noqa: ANN001, ANN202
        g = formulation("retnet").sample(H=q.shape[2], K=1, V=1, T=1)["g"]
        o, state = attnlab.oracle("retnet", "recurrent", "float32")(
            q=q.float(), k=k.float(), v=v.float(), g=g.float(), scale=scale,
            initial_state=None if initial_state is None else initial_state.float(), return_state=True)
        return o.to(q.dtype), (state if output_final_state else None)

    convention = FLA["retnet"]["chunk_retention"]
    target = make_target(retention, "retnet", "fla-style retention", convention)
    names = [p.name for p in properties_for(target, convention, "default", None, ("backward",))]
    assert "backward_matches_oracle[dq]" in names and not any("[dg]" in n for n in names)
    case = Case(name="retnet", seed=1, **SMALL)
    for gradient in ("dq", "dk", "dinitial_state"):
        assert checks.check_backward_matches_oracle(target, case, torch.float32, gradient=gradient).held


class _RoundedOutputBackward(torch.autograd.Function):
    """Softmax attention (causal) whose backward forms D = rowsum(dO o) from its output rounded to the input dtype,
    as FlashAttention-2 does: at T = 1 its dq and dk are fp32 noise where the exact ones are identically zero.
    ``wrong`` adds 10% of |dq| to dq, a defect any T > 1 shows."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wrong: bool) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        logits = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
        T = q.shape[1]
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        p = logits.softmax(-1)
        o = torch.einsum("bhts,bshd->bthd", p, v.float()).to(q.dtype)
        ctx.save_for_backward(q, k, v, p, o)
        ctx.scale, ctx.wrong = scale, wrong
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, p, o = ctx.saved_tensors
        do32 = do.float()
        dp = torch.einsum("bthd,bshd->bhts", do32, v.float())
        rowsum = torch.einsum("bthd,bthd->bht", do32, o.float())  # D from the rounded output
        # dP and D accumulated in different orders (a tensor-core dot, a row sum) differ by fp32 roundoff: modelled
        # as noise of that size, so that at T = 1, where dP = D exactly here, dq and dk are noise, as on a GPU.
        noise = torch.randn(dp.shape, generator=torch.Generator().manual_seed(0)) * 2.0**-24 * dp.abs().amax(-1, keepdim=True)
        ds = p * (dp + noise - rowsum[..., None]) * ctx.scale
        dq = torch.einsum("bhts,bshd->bthd", ds, k.float())
        dk = torch.einsum("bhts,bthd->bshd", ds, q.float())
        dv = torch.einsum("bhts,bthd->bshd", p, do32)
        if ctx.wrong:
            dq = dq + 0.1 * dq.abs().max()
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None


def _fa2_style(wrong: bool) -> Target:
    def kernel(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
               scale: float | None = None) -> torch.Tensor:
        return _RoundedOutputBackward.apply(q, k, v, wrong)

    return function_target(kernel, "softmax", "fa2-style" + (" wrong dq" if wrong else ""))


def test_an_identically_zero_exact_gradient_is_not_measured_relatively() -> None:
    """At T = 1 softmax's exact dq and dk are 0: both floors are 0, and a kernel's fp32 noise there is no defect (the
    case is vacuous, the search goes on); the same kernel with a wrong dq still fails at T = 2, and so does backward
    causality's exact-zero check of the positions after the cut. (float32: fp16 would flush the noise to zero.)"""
    one = Case(name="softmax", seed=0, B=1, T=1, H=1, K=16, V=16, options=(("causal", True),))
    fa2 = _fa2_style(False)
    for gradient in ("dq", "dk"):
        result = checks.check_backward_matches_oracle(fa2, one, torch.float32, gradient=gradient)
        assert result.held and f"the exact {gradient} is identically zero here" in result.detail, result.detail
    shift = checks.check_backward_shift_identity(fa2, one, torch.float32, gradient="dk")
    assert shift.held and "identically zero" in shift.detail
    two = replace(one, T=2)
    assert checks.check_backward_matches_oracle(fa2, two, torch.float32, gradient="dq").held
    assert checks.check_backward_matches_oracle(_fa2_style(True), two, torch.float32, gradient="dq").failed
    cut = replace(one, T=3, cut=1)
    assert checks.check_backward_causality(fa2, cut, torch.float32, gradient="dq").held
