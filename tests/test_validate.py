"""``attnlab validate``, run as a kernel author runs it, on torch kernels written in other conventions.

The kernels below are GLA in flash-linear-attention's convention ([B, T, H, K]
tensors, log gates, scale default K**-0.5, ``output_final_state`` and an
``(o, final_state)`` return), one broken copy, one in an unusual convention
for ``--convention auto`` and one that computes nothing. Each test runs
small (float16/float32 on the CPU, a few examples, short sequences).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.conventions import FLA, FLA_NUMERICS_ENV, detect
from attnlab.registry import formulation
from attnlab.commands.validate import (EXIT_FAILED, EXIT_HELD, EXIT_USAGE, REPRO_CUT, REPRO_END, UsageError,
                                      choose_fla_convention, fla_kernel, load_kernel)

KERNELS = '''
"""GLA in flash-linear-attention's convention, plain torch (fp32 inside)."""
import torch


def _gla(q, k, v, g, scale, initial_state, gate_lag=0, state_kv=True, use_state=True):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q32, k32, v32, g32 = (x.float().transpose(1, 2) for x in (q, k, v, g))
    B, H, T, K = q32.shape
    S = torch.zeros(B, H, K, v32.shape[-1], device=q.device)
    if initial_state is not None and use_state:
        S = initial_state.float().clone() if state_kv else initial_state.float().transpose(-1, -2).clone()
    outputs = []
    for t in range(T):
        S = torch.exp(g32[:, :, max(t - gate_lag, 0), :, None]) * S + k32[:, :, t, :, None] * v32[:, :, t, None, :]
        outputs.append((scale * q32[:, :, t, None, :] @ S)[:, :, 0])
    return torch.stack(outputs, dim=2).transpose(1, 2).to(q.dtype), S


def my_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Correct, fla's convention (not named like an fla kernel: its signature says which one)."""
    o, S = _gla(q, k, v, g, scale, initial_state)
    return o, (S if output_final_state else None)


def stale_gate_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Broken: token t decays the state by the previous token's gate."""
    o, S = _gla(q, k, v, g, scale, initial_state, gate_lag=1)
    return o, (S if output_final_state else None)


def forgets_state_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Broken: ignores the initial state (its output from zero is right)."""
    o, S = _gla(q, k, v, g, scale, initial_state, use_state=False)
    return o, (S if output_final_state else None)


def unusual_gla(q, k, v, decay, initial_state=None):
    """Correct, unusual: positional, decay factors exp(g), scale always 1, state [V, K], always (o, state)."""
    o, S = _gla(q, k, v, torch.log(decay.float()), 1.0, initial_state, state_kv=False)
    return o, S.transpose(-1, -2)


def h0_gla(q, k, v, decay, h0=None):
    """unusual_gla whose initial state is called h0."""
    return unusual_gla(q, k, v, decay, initial_state=h0)


def not_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    return torch.zeros_like(v), None


def late_drift_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Broken past T=24 (beyond --convention auto's T=20 probe): later outputs drift by 10%."""
    o, S = _gla(q, k, v, g, scale, initial_state)
    if o.shape[1] > 24:
        o = torch.cat([o[:, :24], 1.1 * o[:, 24:]], dim=1)
    return o, (S if output_final_state else None)
'''

# The forward pass only: these kernels are differentiable (plain torch), and tests/test_gradient_properties.py judges
# backward passes.
FAST = ["--device", "cpu", "--examples", "3", "--no-progress", "--passes", "forward"]


@pytest.fixture()
def kernels(tmp_path: Path) -> Path:
    path = tmp_path / "fla_style.py"
    path.write_text(textwrap.dedent(KERNELS))
    return path


def run(*argv: str) -> tuple[int, str, str]:
    """``attnlab validate ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["validate", *argv])
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def table_lines(stdout: str) -> dict[tuple[str, str, str], str]:
    """The verdict table's lines by (strategy, dtype, property)."""
    lines = {}
    for line in stdout.splitlines():
        cells = line.split()
        if len(cells) >= 4 and cells[0] in ("default", "adversarial"):
            lines[(cells[0], cells[1], cells[2])] = line
    return lines


def test_a_correct_kernel_in_fla_convention_passes_with_report(kernels: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run("--formulation", "gla", "--kernel", f"{kernels}:my_gla", "--convention", "fla",
                               "--dtype", "float16", "--lengths", "16,32", "--out", str(out), *FAST)
    assert code == EXIT_HELD, stdout + stderr
    assert "convention fla:chunk_gla" in stdout
    lines = table_lines(stdout)
    expected = {("default", p) for p in ("matches_oracle", "causality", "split_and_resume")}
    expected |= {("adversarial", p) for p in ("matches_oracle", "overflow", "causality", "split_and_resume")}
    assert {(s, p) for s, _, p in lines} == expected
    assert all(" held " in line for line in lines.values()), stdout
    assert "verdict: PASS" in stdout

    data = json.loads((out / "report.json").read_text())
    assert data["held"] is True and data["exit_code"] == 0 and len(data["verdicts"]) == 7
    assert data["convention"]["name"] == "fla:chunk_gla" and data["convention"]["final_state_flag"] == "output_final_state"
    assert set(FLA_NUMERICS_ENV) <= set(data["env"])
    for v in data["verdicts"]:
        assert v["status"] == "held" and v["examples"] >= 3 and v["case"].startswith("Case(name='gla'")
        assert v["figure"] is not None and v["figure"] <= v["bound"]
    # The curve: the kernel and attnlab's own kernels side by side, at each length.
    rows = data["curve"]["rows"]
    mine = {r["T"]: r for r in rows if r["impl"] == f"{kernels}:my_gla"}
    assert sorted(mine) == [16, 32] and all(r["error"] is None and r["excess"] <= 2.0 for r in mine.values())
    assert {"attnlab:chunkwise", "attnlab:recurrent", "fp32-recurrent"} <= {r["impl"] for r in rows}
    summary = (out / "summary.md").read_text()
    assert "**PASS: every property held**" in summary and "| default | float16 | matches_oracle | held |" in summary
    assert f"`{kernels}:my_gla`" in summary and "T=16" in summary and "curve/gla.png" in summary
    assert (out / "curve" / "gla.png").stat().st_size > 0
    assert f"`{kernels}:my_gla`" in (out / "curve" / "index.md").read_text()


def test_a_broken_kernel_fails_through_the_command_line(kernels: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "attnlab.cli", "validate", "--formulation", "gla",
               "--kernel", "fla_style:stale_gate_gla", "--convention", "fla", "--fla-op", "chunk_gla",
               "--dtype", "float16", "--strategy", "default", "--properties", "matches_oracle,causality",
               "--lengths", "none", "--out", str(out), *FAST]
    result = subprocess.run(command, cwd=kernels.parent, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ))
    assert result.returncode == EXIT_FAILED, result.stdout[-3000:] + result.stderr[-3000:]
    lines = table_lines(result.stdout)
    assert " FAILED " in lines[("default", "float16", "matches_oracle")]
    assert " held " in lines[("default", "float16", "causality")]  # the defect is not a causality violation
    assert "property matches_oracle FAILED for fla_style:stale_gate_gla in float16 on cpu" in result.stdout
    assert "verdict: FAIL: 1 failed of 2 property runs (matches_oracle)" in result.stdout

    data = json.loads((out / "report.json").read_text())
    assert data["held"] is False and data["exit_code"] == 1 and "curve" in data and not data["curve"].get("rows")
    failed = next(v for v in data["verdicts"] if v["property"] == "matches_oracle")
    assert failed["status"] == "failed" and failed["figure"] > failed["correctness"] > failed["bound"]
    # The minimized case is no larger than the one found, and the repro script reproduces the failure.
    case, found = (eval(failed[key], {"Case": __import__("attnlab.properties.strategies", fromlist=["Case"]).Case})
                   for key in ("case", "found"))
    assert (case.T, case.K, case.V, case.B, case.H) <= (found.T, found.K, found.V, found.B, found.H)
    assert case.T <= found.T and case.K <= found.K
    script = data["repro"]["default/float16/matches_oracle"]
    assert "from fla_style import stale_gate_gla" in script and "fla_convention('gla', 'chunk_gla')" in script
    printed = io.StringIO()
    sys.path.insert(0, str(kernels.parent))
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "repro.py", "exec"), {"__name__": "repro"})
    finally:
        sys.path.remove(str(kernels.parent))
    assert "property matches_oracle FAILED" in printed.getvalue()
    assert "## Failures" in (out / "summary.md").read_text()
    # The script as printed: unindented between the cut lines, a file that runs from anywhere and reproduces it.
    printed_script = result.stdout.split(REPRO_CUT + "\n", 1)[1].split("\n" + REPRO_END, 1)[0]
    assert printed_script.strip() == script.strip() and not printed_script.startswith(" ")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "repro.py").write_text(printed_script + "\n")
    rerun = subprocess.run([sys.executable, "repro.py"], cwd=tmp_path / "elsewhere", capture_output=True, text=True,
                           timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert rerun.returncode == 1, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "property matches_oracle FAILED" in rerun.stdout and "excess = rel_err / floor = " in rerun.stdout


def test_a_kernel_that_ignores_the_initial_state_fails_split_and_resume(kernels: Path) -> None:
    code, stdout, _ = run("--formulation", "gla", "--kernel", f"{kernels}:forgets_state_gla", "--convention", "fla",
                          "--dtype", "float32", "--strategy", "default", "--lengths", "none", *FAST)
    assert code == EXIT_FAILED, stdout
    lines = table_lines(stdout)
    assert " FAILED " in lines[("default", "float32", "split_and_resume")]
    assert " held " in lines[("default", "float32", "matches_oracle")]


def test_auto_finds_an_unusual_convention_and_validates_under_it(kernels: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run("--formulation", "gla", "--kernel", f"{kernels}:unusual_gla", "--convention", "auto",
                               "--dtype", "float32", "--strategy", "default", "--lengths", "16", "--no-compare",
                               "--out", str(out), *FAST)
    assert code == EXIT_HELD, stdout + stderr
    assert ("--convention auto: found positional=('q', 'k', 'v', 'g'), gates='linear', scale=1.0, state='VK', "
            "final_state_flag=None, returns='o_state'") in stdout
    lines = table_lines(stdout)
    assert {p for _, _, p in lines} == {"matches_oracle", "causality", "split_and_resume"}  # state properties run
    assert all(" held " in line for line in lines.values())
    data = json.loads((out / "report.json").read_text())
    c = data["convention"]
    assert (c["gates"], c["scale"], c["state"], c["returns"], c["positional"]) == ("linear", 1.0, "VK", "o_state",
                                                                                    ["q", "k", "v", "g"])
    assert data["detection"]["errors"]["auto(gates=log, scale=pass, returns=attnlab, keywords)"] is None  # it raised
    # Every case was drawn with the kernel's own scale, 1.
    assert all("scale=1.0" in v["case"] for v in data["verdicts"])
    assert all(r["excess"] <= 64 for r in data["curve"]["rows"])


def test_auto_finds_a_state_keyword_other_than_initial_state(kernels: Path) -> None:
    found = detect(load_kernel(f"{kernels}:h0_gla"), "gla", formulation("gla").sample(B=1, T=12, H=2, K=4, V=3, seed=1),
                   tolerance=1e-5)
    assert found.convention is not None
    assert (found.convention.state_keyword, found.convention.state) == ("h0", "VK")


def test_auto_says_plainly_when_no_convention_matches(kernels: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, _ = run("--formulation", "gla", "--kernel", f"{kernels}:not_gla", "--convention", "auto",
                          "--dtype", "float16", "--lengths", "none", "--out", str(out), *FAST)
    assert code == EXIT_FAILED
    assert "--convention auto: NO convention matched: none of the 36 candidates" in stdout
    # What was tried and the closest candidate with its error: "wrong convention" told from "wrong kernel".
    assert "closest: gates=log, scale=pass, returns=o_state, keywords: rel_err 1" in stdout
    assert "(gates log or linear, scale passed, K**-0.5 or 1" in stdout
    assert "verdict: FAIL (no convention matched; nothing validated)" in stdout
    assert table_lines(stdout) == {}
    data = json.loads((out / "report.json").read_text())
    assert data["convention"] is None and data["verdicts"] == [] and data["exit_code"] == 1
    assert "NO convention matched" in (out / "summary.md").read_text()


def test_auto_finds_the_final_state_flag_of_an_fla_style_kernel(kernels: Path) -> None:
    my_gla = load_kernel(f"{kernels}:my_gla")
    x = formulation("gla").sample(B=1, T=12, H=2, K=4, V=3, seed=1)
    found = detect(my_gla, "gla", x, tolerance=1e-5)  # fp32 inside
    assert found.convention is not None
    assert (found.convention.returns, found.convention.final_state_flag) == ("o_state", "output_final_state")
    assert math.isinf(found.errors["auto(gates=log, scale=pass, returns=o_state, keywords, state=KV, final state without a flag)"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--formulation", "gla", "--kernel", "fla_style"], "must be MODULE:FUNCTION"),
        (["--formulation", "gla", "--kernel", "no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'"),
        (["--formulation", "gla", "--kernel", "KERNELS:nothing"], "has no attribute 'nothing'"),
        (["--formulation", "gla", "--kernel", "missing/file.py:f"], "no such file 'missing/file.py'"),
        (["--formulation", "flash", "--kernel", "KERNELS:my_gla"], "unknown formulation 'flash'"),
        (["--kernel", "KERNELS:my_gla"], "--formulation NAME is required"),
        (["--formulation", "gla", "--kernel", "KERNELS:my_gla", "--dtype", "float8"], "dtype must be one of"),
        (["--formulation", "gla", "--kernel", "KERNELS:my_gla", "--convention", "fla", "--fla-op", "chunk_kda"],
         "fla's kernels of gla are chunk_gla, fused_recurrent_gla"),
        (["--fla-op", "chunk_nothing"], "not a kernel attnlab knows fla's convention of"),
        (["--formulation", "gla", "--kernel", "KERNELS:my_gla", "--device", "gpu"], "invalid choice: 'gpu'"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(kernels: Path, argv: list[str], message: str) -> None:
    argv = [a.replace("KERNELS", str(kernels)) for a in argv]
    code, stdout, stderr = run(*argv, "--device", "cpu", "--no-progress") if "--device" not in argv else run(*argv)
    assert code == EXIT_USAGE, stdout + stderr
    assert message in stderr, stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_is_a_usage_error(kernels: Path) -> None:
    code, _, stderr = run("--formulation", "gla", "--kernel", f"{kernels}:my_gla", "--device", "cuda")
    assert code == EXIT_USAGE and "no CUDA GPU" in stderr


def test_fla_conventions_are_chosen_by_name_signature_or_fla_op(kernels: Path) -> None:
    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False): ...
    def recurrent(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False): ...
    def simple(q, k, v, g_gamma=None, scale=None, initial_state=None, output_final_state=False): ...
    def retention(q, k, v, scale=None, initial_state=None, output_final_state=False): ...
    def anything(*args, **kwargs): ...

    assert choose_fla_convention("gla", chunk_gla, "chunk_gla", None) is FLA["gla"]["chunk_gla"]
    assert choose_fla_convention("gla", recurrent, "recurrent", None) is FLA["gla"]["fused_recurrent_gla"]
    assert choose_fla_convention("retnet", simple, "simple", None) is FLA["retnet"]["chunk_simple_gla"]
    assert choose_fla_convention("retnet", retention, "retention", None) is FLA["retnet"]["chunk_retention"]
    assert choose_fla_convention("gla", anything, "anything", "fused_recurrent_gla") is FLA["gla"]["fused_recurrent_gla"]
    with pytest.raises(UsageError, match="pass --fla-op with one of chunk_gla, fused_recurrent_gla"):
        choose_fla_convention("gla", anything, "anything", None)
    with pytest.raises(UsageError, match="fla 0.6.0 has no kernel of aft"):
        choose_fla_convention("aft", anything, "anything", None)
    assert fla_kernel("fused_recurrent_rwkv4") == ("rwkv4", "fla.ops.rwkv4:fused_recurrent_rwkv4")
    assert fla_kernel("fused_recurrent_gla") == ("gla", "fla.ops:fused_recurrent_gla")
    assert fla_kernel("fused_recurrent_gla", "general") == ("general", "fla.ops:fused_recurrent_gla")


def test_a_kernel_called_in_the_wrong_convention_is_a_usage_error(kernels: Path) -> None:
    # my_gla takes g, fla's fused_recurrent_gla convention passes gk: said at once, not as seven failed properties.
    code, stdout, stderr = run("--formulation", "gla", "--kernel", f"{kernels}:my_gla", "--convention", "fla",
                               "--fla-op", "fused_recurrent_gla", "--dtype", "float16", "--lengths", "none", *FAST)
    assert code == EXIT_USAGE, stdout + stderr
    assert "cannot be called in convention fla:fused_recurrent_gla: TypeError" in stderr and "'gk'" in stderr
    assert table_lines(stdout) == {}


def _linear_attn_kernel(carry_z: bool):
    """Linear attention with the feature map applied outside (fla's convention), plain torch in fp32.

    ``carry_z=False``: the state is S alone (the normalizer z is kept nowhere);
    ``carry_z=True``: fla 0.6.0's layout, S alone when normalize=False and
    ``(S, z)`` with z as ``[B, 1, H, K]`` when normalized."""

    def kernel(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q32, k32, v32 = (x.float().transpose(1, 2) for x in (q, k, v))
        B, H, T, K = q32.shape
        S = torch.zeros(B, H, K, v32.shape[-1])
        z = torch.zeros(B, H, K)
        if initial_state is not None:
            if carry_z and normalize:
                S, z = initial_state[0].float().clone(), initial_state[1].float()[:, 0].clone()
            else:
                S = initial_state.float().clone()
        outputs = []
        for t in range(T):
            S = S + k32[:, :, t, :, None] * v32[:, :, t, None, :]
            z = z + k32[:, :, t]
            num = (q32[:, :, t, None, :] @ S)[:, :, 0]
            outputs.append(num / (q32[:, :, t] * z).sum(-1, keepdim=True) if normalize else scale * num)
        o = torch.stack(outputs, dim=2).transpose(1, 2).to(q.dtype)
        state = (S, z[:, None]) if carry_z and normalize else S
        return o, (state if output_final_state else None)

    return kernel


@pytest.mark.parametrize("normalize", [False, True])
def test_a_kernel_whose_state_omits_the_normalizer(normalize: bool) -> None:
    """The convention says which state parts a kernel carries: the parts carried are compared, and where a run
    needs one it omits (a normalized run needs z) split_and_resume says so plainly instead of crashing."""
    from dataclasses import replace

    from attnlab.properties import checks
    from attnlab.properties.strategies import Case
    from attnlab.commands.validate import make_target

    convention = replace(FLA["linear_attn"]["fused_recurrent_linear_attn"], name="S only", carries=(("", ("S",)),),
                         part_unsqueeze={})
    target = make_target(_linear_attn_kernel(carry_z=False), "linear_attn", "standin:s_only", convention)
    assert target.accepts_state
    case = Case(name="linear_attn", seed=3, B=1, T=8, H=2, K=8, V=8, cut=3,
                options=(("feature_map", "elu1"), ("normalize", normalize)))
    result = checks.check_split_and_resume(target, case, torch.float32, "cpu")
    if normalize:
        assert not result.held and result.measure == "state parts carried"
        assert "omits the normalizer z" in result.detail and "cannot be split and resumed" in result.detail
    else:
        assert result.held, result.message()
        assert "compared on S" in result.detail


@pytest.mark.parametrize("normalize", [False, True])
def test_fla_linear_attn_convention_carries_s_or_s_and_z(normalize: bool) -> None:
    """fla 0.6.0's linear attention: S alone when normalize=False, (S, z [B, 1, H, K]) when normalized."""
    from attnlab.properties import checks
    from attnlab.properties.strategies import Case
    from attnlab.commands.validate import make_target

    convention = FLA["linear_attn"]["chunk_linear_attn"]
    target = make_target(_linear_attn_kernel(carry_z=True), "linear_attn", "standin:fla_like", convention)
    case = Case(name="linear_attn", seed=5, B=2, T=8, H=2, K=8, V=8, cut=5,
                options=(("feature_map", "elu1"), ("normalize", normalize)))
    result = checks.check_split_and_resume(target, case, torch.float32, "cpu")
    assert result.held, result.message()
    _, state = target(**case.call(torch.float32, "cpu"), return_state=True)
    assert state[0].shape == (2, 2, 8, 8)
    assert (state[1] is None) != normalize and (not normalize or state[1].shape == (2, 2, 8))


def test_convention_peer_calls_a_registered_peer_as_the_registry_declares():
    """torch's SDPA (math backend) in its own head-first convention, from the softmax entry's peers."""
    code, out, _ = run("--kernel", "attnlab.third_party:sdpa_math", "--formulation", "softmax", "--convention", "peer",
                       "--dtype", "float32", "--device", "cpu", "--examples", "2", "--no-progress", "--no-compare",
                       "--lengths", "8")
    assert code == EXIT_HELD, out
    assert "convention torch:sdpa" in out and "backward_matches_oracle[dq]" in out


def test_convention_peer_refuses_a_function_the_registry_does_not_list():
    code, _, err = run("--kernel", "attnlab.third_party:sdpa_math", "--formulation", "gla", "--convention", "peer",
                       *FAST)
    assert code == EXIT_USAGE and "not a peer of gla" in err and "fla.ops:chunk_gla" in err


def test_auto_says_a_failure_may_be_the_detections(kernels: Path, tmp_path: Path) -> None:
    """A kernel right on the small probe inputs (so a convention matches) but wrong at longer T: the verdict
    output says the convention was detected on the probe's sizes, and how to rule the detection out."""
    out = tmp_path / "out"
    code, stdout, stderr = run("--formulation", "gla", "--kernel", f"{kernels}:late_drift_gla", "--convention", "auto",
                               "--dtype", "float32", "--strategy", "default", "--properties", "matches_oracle",
                               "--examples", "12", "--lengths", "none", "--out", str(out),
                               *[a for a in FAST if a not in ("--examples", "3")])
    assert code == EXIT_FAILED, stdout + stderr
    assert "--convention auto: found" in stdout and " FAILED " in stdout
    caveat = ("note: the convention was detected on T=20, K=8, V=6 probe inputs; a failure may also mean the "
              "detection was wrong: pass --convention explicitly to rule it out")
    assert caveat in stdout
    assert caveat.removeprefix("note: ") in (out / "summary.md").read_text()
    # The reproducer of a detected convention writes it out (attnlab.conventions.Convention(...)) and runs as a file.
    script = stdout.split(REPRO_CUT + "\n", 1)[1].split("\n" + REPRO_END, 1)[0]
    assert "Convention(name='auto(gates=log, scale=pass, returns=o_state, keywords" in script
    (tmp_path / "repro.py").write_text(script + "\n")
    rerun = subprocess.run([sys.executable, str(tmp_path / "repro.py")], capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 1 and "property matches_oracle FAILED" in rerun.stdout, rerun.stdout + rerun.stderr
    # A kernel that holds under auto gets no such note.
    code, stdout, _ = run("--formulation", "gla", "--kernel", f"{kernels}:my_gla", "--convention", "auto",
                          "--dtype", "float32", "--strategy", "default", "--properties", "matches_oracle",
                          "--lengths", "none", *FAST)
    assert code == EXIT_HELD and "detection was wrong" not in stdout
