"""The pytest plugin, run the way a kernel author runs it: a subprocess on a module outside attnlab.

``pytest --pyargs attnlab.properties --attnlab-formulation gla --attnlab-kernel mykernels:FUNCTION``
must exit 0 on a correct kernel and 1 on a broken one, whose report names
the property, the figure, the bound and the reproducing input; an imprecise
result passes with a warning unless ``--attnlab-strict``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

THIRD_PARTY_KERNELS = '''
"""A kernel author's GLA, in plain torch: S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)."""
import torch


def gla(*, q, k, v, g, scale=None, initial_state=None, return_state=False, decay_offset=0):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q32, k32, v32, g32 = (x.float().transpose(1, 2) for x in (q, k, v, g))
    B, H, T, K = q32.shape
    S = torch.zeros(B, H, K, v32.shape[-1], device=q.device) if initial_state is None else initial_state.float().clone()
    outputs = []
    for t in range(T):
        decay = torch.exp(g32[:, :, max(t - decay_offset, 0), :, None])
        S = decay * S + k32[:, :, t, :, None] * v32[:, :, t, None, :]
        outputs.append((scale * q32[:, :, t, None, :] @ S)[:, :, 0])
    o = torch.stack(outputs, dim=2).transpose(1, 2).to(q.dtype)
    return (o, S) if return_state else o


def good(*, q, k, v, g, scale=None, initial_state=None, return_state=False):
    return gla(q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state, return_state=return_state)


def stale_gate(*, q, k, v, g, scale=None):
    """Broken: token t decays the state by the previous token's gate."""
    return gla(q=q, k=k, v=v, g=g, scale=scale, decay_offset=1)


_context_lost = False


def faults_once(*, q, k, v, g, scale=None, initial_state=None, return_state=False):
    """Stands for a kernel whose launch faults once in the run, in the first test that calls it (the file
    FAULT_MARKER names does not exist yet): that call and every later one in its process raise CUDA's sticky error,
    as a lost context does; other processes run it correctly."""
    import os
    global _context_lost
    marker = os.environ["FAULT_MARKER"]
    if "PYTEST_CURRENT_TEST" in os.environ and not os.path.exists(marker):
        open(marker, "w").close()
        _context_lost = True
    if _context_lost:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return good(q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state, return_state=return_state)
'''


def run_properties(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "mykernels.py").write_text(textwrap.dedent(THIRD_PARTY_KERNELS))
    command = [sys.executable, "-m", "pytest", "--pyargs", "attnlab.properties", "-q", "-p", "no:cacheprovider",
               "--attnlab-profile", "ci", "--attnlab-device", "cpu", *options]
    if not any(o.startswith("--attnlab-passes") for o in options):
        command += ["--attnlab-passes", "forward"]  # these kernels are differentiable: the backward is tested below
    # A fresh pytest, as a user starts it: none of this test's own PYTEST_* variables (PYTEST_CURRENT_TEST would
    # make faults_once fault outside a test).
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    # COLUMNS as a pipe's default: the short summary's lines are cut to the width, so a wider one repeats more text.
    env |= {"PYTHONPATH": str(tmp_path), "FAULT_MARKER": str(tmp_path / "faulted"), "COLUMNS": "80"}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)


FAULTING = ("--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels:faults_once", "--attnlab-dtype", "float32",
            "-rA")


def failure_reports(stdout: str) -> str:
    """The report's failure sections, without the short summary that repeats their first lines."""
    return stdout.split(" short test summary info ")[0]


def test_a_cuda_fault_is_reported_as_drawn_and_the_tests_after_it_are_not_run(tmp_path: Path) -> None:
    stdout = run_properties(tmp_path, *FAULTING).stdout
    assert "4 failed" in stdout, stdout[-4000:]
    report = failure_reports(stdout)
    assert report.count("CUDA FAULT in ") == 1 and "the kernel's launch lost this process's CUDA context" in report
    assert "the implementation raised" in report and "an illegal memory access was encountered" in report
    assert "input: Case(name='gla', seed=" in report
    assert "Falsifying example" not in report  # never shrunk
    assert report.count("NOT RUN: this process's CUDA context was lost earlier, in ") == 3


def test_under_xdist_a_fresh_worker_runs_the_tests_after_a_cuda_fault(tmp_path: Path) -> None:
    stdout = run_properties(tmp_path, *FAULTING, "-n", "1").stdout
    assert "2 failed, 2 passed" in stdout, stdout[-4000:]
    report = failure_reports(stdout)
    assert report.count("CUDA FAULT in ") == 1 and "crashed" in report and "NOT RUN" not in report


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_correct_third_party_kernel_passes(tmp_path: Path, dtype: str) -> None:
    result = run_properties(tmp_path, "--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels:good",
                            "--attnlab-dtype", dtype, "-rA")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = [line for line in result.stdout.splitlines() if line.startswith("PASSED ")]
    for prop in ("matches_oracle", "overflow", "causality", "split_and_resume"):  # state: its signature takes it
        assert any(line.endswith(f"::test_kernel_property[{prop}-mykernels:good-{dtype}]") for line in passed), passed
    assert "chunk_size_invariance" not in result.stdout  # it takes no chunk_size
    assert len(passed) == 4 and "failed" not in result.stdout


def test_a_broken_third_party_kernel_fails_with_an_actionable_report(tmp_path: Path) -> None:
    result = run_properties(tmp_path, "--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels:stale_gate",
                            "--attnlab-dtype", "float16", "-k", "matches_oracle or causality")
    report = result.stdout
    assert result.returncode == 1, report[-4000:] + result.stderr[-2000:]
    assert "FAILED" in report and "test_kernel_property[matches_oracle-mykernels:stale_gate-float16]" in report
    assert "property matches_oracle FAILED for mykernels:stale_gate in float16 on cpu" in report
    assert "figure: excess = rel_err / floor = " in report and "bound: 2" in report
    assert "input: Case(name='gla', seed=" in report and "reproduce: " in report
    assert "1 failed, 1 passed" in report  # causality holds: the defect is not a causality violation


def test_an_imprecise_result_passes_with_a_warning_and_fails_under_strict(tmp_path: Path) -> None:
    """--attnlab-bound 0.5 holds the correct kernel (one rounding of an fp32 result: excess about 1) to half a
    rounding: every input is then imprecise, never failed. It passes with an ImpreciseWarning, and
    --attnlab-strict fails it."""
    options = ("--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels:good", "--attnlab-dtype", "float16",
               "--attnlab-bound", "0.5", "-k", "matches_oracle")
    lenient = run_properties(tmp_path, *options)
    assert lenient.returncode == 0, lenient.stdout[-4000:] + lenient.stderr[-2000:]
    assert "ImpreciseWarning" in lenient.stdout
    assert "property matches_oracle IMPRECISE for mykernels:good" in lenient.stdout
    assert "1 passed" in lenient.stdout
    strict = run_properties(tmp_path, *options, "--attnlab-strict")
    assert strict.returncode == 1, strict.stdout[-4000:] + strict.stderr[-2000:]
    assert "property matches_oracle IMPRECISE for mykernels:good in float16 on cpu" in strict.stdout
    assert "bound: 0.5 (held)" in strict.stdout and "1 failed" in strict.stdout


@pytest.mark.parametrize(
    "options, message",
    [
        (["--attnlab-kernel", "mykernels:good"], "--attnlab-kernel needs --attnlab-formulation"),
        (["--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels"], "must be MODULE:FUNCTION"),
        (["--attnlab-formulation", "gla", "--attnlab-kernel", "nosuchmodule:f"], "cannot import module 'nosuchmodule'"),
        (["--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels:nothing"], "has no attribute 'nothing'"),
        (["--attnlab-formulation", "flash", "--attnlab-kernel", "mykernels:good"], "expected one of softmax"),
        (["--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels:good", "--attnlab-bound", "2"],
         "--attnlab-bound needs --attnlab-dtype"),
        (["--attnlab-formulation", "gla", "--attnlab-kernel", "mykernels:good", "--attnlab-dtype", "float16",
          "--attnlab-bound", "-1"], "expected a positive multiple of the floor"),
    ],
)
def test_bad_options_are_usage_errors(tmp_path: Path, options: list[str], message: str) -> None:
    result = run_properties(tmp_path, *options)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in result.stderr


FLA_STYLE_KERNELS = '''
"""GLA as flash-linear-attention calls it: gates as decay factors exp(g), (o, state or None) returned."""
import torch

from mykernels import gla


def fla_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    o, S = gla(q=q, k=k, v=v, g=torch.log(g.float()), scale=scale, initial_state=initial_state, return_state=True)
    return o, (S if output_final_state else None)


def late_drift(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Broken past T=24 only: --attnlab-convention auto's T=20 probe matches, the properties then fail."""
    o, S = fla_gla(q, k, v, g, scale, initial_state, output_final_state)
    if o.shape[1] > 24:
        o = torch.cat([o[:, :24], 1.1 * o[:, 24:]], dim=1)
    return o, S


def zeros(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    return torch.zeros_like(v), None


def unit_scale(q, k, v, g):
    """Always scale 1: a convention the plugin's suites cannot draw cases for."""
    return fla_gla(q, k, v, g, scale=1.0)[0]
'''


def run_fla_style(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    """run_properties on FLA_STYLE_KERNELS (built on THIRD_PARTY_KERNELS' gla, which run_properties writes)."""
    (tmp_path / "flastyle.py").write_text(textwrap.dedent(FLA_STYLE_KERNELS))
    return run_properties(tmp_path, "--attnlab-formulation", "gla", "--attnlab-dtype", "float32", *options)


def test_the_plugins_conventions_are_validates() -> None:
    from attnlab.conventions import CONVENTION_CHOICES
    from attnlab.pytest_plugin import CONVENTION_CHOICES as plugin_choices

    assert plugin_choices == CONVENTION_CHOICES


def test_convention_auto_finds_an_fla_style_kernel_and_attnlab_refuses_it(tmp_path: Path) -> None:
    found = run_fla_style(tmp_path, "--attnlab-kernel", "flastyle:fla_gla", "--attnlab-convention", "auto", "-rA")
    assert found.returncode == 0, found.stdout[-4000:] + found.stderr[-2000:]
    assert ("attnlab: --attnlab-convention auto: found gates='linear', final_state_flag='output_final_state', "
            "returns='o_state'") in found.stdout
    passed = [line for line in found.stdout.splitlines() if line.startswith("PASSED ")]
    for prop in ("matches_oracle", "causality", "split_and_resume"):  # through the adapter, its state too
        assert any(f"[{prop}-flastyle:fla_gla-float32]" in line for line in passed), passed
    assert "detection was wrong" not in found.stdout
    unit = run_fla_style(tmp_path, "--attnlab-kernel", "flastyle:unit_scale", "--attnlab-convention", "auto")
    assert unit.returncode == 4, unit.stdout[-2000:] + unit.stderr[-2000:]
    assert "always computes with scale=1.0" in unit.stderr and "attnlab validate --formulation gla" in unit.stderr
    # In attnlab's convention (the default) it returns a tuple where o is due: a usage error that says so.
    default = run_fla_style(tmp_path, "--attnlab-kernel", "flastyle:fla_gla")
    assert default.returncode == 4, default.stdout[-2000:] + default.stderr[-2000:]
    assert ("flastyle:fla_gla does not follow convention attnlab: called without return_state it returned a tuple "
            "of 2 items") in default.stderr
    assert "pass --attnlab-convention fla, peer or auto" in default.stderr


def test_convention_auto_in_the_plugin_says_what_it_tried_and_what_a_failure_may_mean(tmp_path: Path) -> None:
    none = run_fla_style(tmp_path, "--attnlab-kernel", "flastyle:zeros", "--attnlab-convention", "auto")
    assert none.returncode == 4, none.stdout[-2000:] + none.stderr[-2000:]
    assert "--attnlab-convention auto: NO convention matched: none of the 36 candidates tried" in none.stderr
    assert "closest: gates=log, scale=pass, returns=o_state, keywords: rel_err 1" in none.stderr
    drift = run_fla_style(tmp_path, "--attnlab-kernel", "flastyle:late_drift", "--attnlab-convention", "auto",
                          "-k", "matches_oracle")
    assert drift.returncode == 1, drift.stdout[-4000:] + drift.stderr[-2000:]
    assert "attnlab: --attnlab-convention auto: found gates='linear'" in drift.stdout
    assert ("attnlab: the convention was detected on T=20, K=8, V=6 probe inputs; a failure may also mean the "
            "detection was wrong: pass --attnlab-convention explicitly to rule it out") in drift.stdout


def test_convention_without_a_kernel_is_a_usage_error(tmp_path: Path) -> None:
    result = run_properties(tmp_path, "--attnlab-formulation", "gla", "--attnlab-convention", "auto")
    assert result.returncode == 4 and "--attnlab-convention auto needs --attnlab-kernel" in result.stderr
