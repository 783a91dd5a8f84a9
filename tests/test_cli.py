"""The command line, run the way a user runs it: exit codes and verdicts, on tiny sizes (seconds each).

Every command exits 0 when it did what was asked, 1 when a result failed (a property failed, a point raised,
a defect escaped) and 2 for a usage error. The grading tests call ``attnlab validate`` on a kernel that is the
float64 oracle times ``(1 + eps)``, rounded once to the input dtype: its excess is about ``eps / floor``, so
``eps`` puts it where a test wants it against the registry's bounds.
"""

from __future__ import annotations

import json
import math
import re
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.kernel import backward_forms
from attnlab.registry import BOUNDS
from attnlab.runtime import interpreter_active

ON_THE_INTERPRETER = not torch.cuda.is_available() and interpreter_active()


def run_cli(*args: str, cwd: Path | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    """``python -m attnlab.cli ARGS``; with ``prelude``, that code runs first in the same process (to break
    something); ``cwd`` is also put on the import path (a kernel module written there)."""
    if prelude:
        entry = f"{prelude}\nimport sys\nfrom attnlab.cli import main\nsys.exit(main())"
        command = [sys.executable, "-c", entry, *args]
    else:
        command = [sys.executable, "-m", "attnlab.cli", *args]
    path = [str(cwd)] if cwd else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_list_shows_every_formulation_with_forms_and_precisions():
    result = run_cli("list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["#", "formulation"]
    body = [line.split()[1] for line in lines[2:]]
    assert body == attnlab.names()
    assert all("recurrent, parallel, chunkwise" in line and "float64, mpmath" in line for line in lines[2:])
    header = re.split(r"\s{2,}", lines[0])
    column = header.index("kernels' backward")
    shown = {name: re.split(r"\s{2,}", line)[column] for line, name in zip(lines[2:], attnlab.names())}
    for name, forms in shown.items():  # which kernels train: their modules' BACKWARD
        assert forms == (", ".join(backward_forms(name)) or "none"), (name, forms)
    # As built today: every kernel form trains.
    assert shown["gla"] == shown["deltanet"] == shown["kda"] == "chunkwise, recurrent", shown


def test_unknown_command_and_formulation_are_refused_with_usage():
    result = run_cli("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = run_cli("bench", "--formulations", "gla,flash")
    assert result.returncode == 2 and "unknown formulation(s) flash" in result.stderr


# ----------------------------------------------------------------------------- usage errors: 2, before any work
# (report's and map's other argument errors: tests/test_report.py)


@pytest.mark.parametrize(
    "args, message",
    [
        (("selftest", "--formulations", "nosuch"), "unknown formulation(s) nosuch"),
        (("selftest", "--dtypes", "float8"), "unknown dtype(s) float8"),
        (("selftest", "--examples", "0"), "expected a positive integer"),
        (("selftest", "--jobs", "0"), "expected a positive integer"),
        (("map", "gate", "--formulations", "nosuch"), "unknown formulation(s) nosuch"),
        (("map", "gate", "--dtypes", "half"), "unknown dtype(s) half"),
        (("validate", "--formulation", "nosuch", "--kernel", "x:y"), "unknown formulation 'nosuch'"),
        (("validate", "--formulation", "gla", "--kernel", "x:y", "--dtype", "float8"), "dtype must be one of"),
        (("validate", "--formulation", "gla", "--kernel", "x:y", "--bound", "0"), "--bound must be a positive number"),
        (("validate", "--formulation", "gla", "--kernel", "x:y", "--bound", "2", "--dtype", "float16,float32"),
         "give exactly one --dtype"),
        (("bench", "--dtype", "float8"), "invalid choice: 'float8'"),
        (("bench", "--passes", "forward,sideways"), "unknown pass(es) sideways; expected some of forward, backward"),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    result = run_cli(*args, *(("--out", str(tmp_path / "out")) if args[0] in ("report", "map") else ()))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not ON_THE_INTERPRETER, reason="bfloat16 is refused where the kernels run under the interpreter")
@pytest.mark.parametrize("command", [("report", "--formulations", "gla"), ("map", "shift", "--formulations", "rwkv4")])
def test_bfloat16_on_the_interpreter_is_refused_before_any_work(command: tuple[str, ...], tmp_path: Path) -> None:
    """Every kernel point would fail (the interpreter computes bf16 on bit patterns): a usage error, not 1."""
    result = run_cli(*command, "--dtypes", "float16,bfloat16", "--device", "cpu", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "bfloat16 needs a GPU" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not ON_THE_INTERPRETER, reason="attnlab's kernels take bfloat16 on a GPU")
def test_selftest_with_nothing_to_run_exits_2() -> None:
    result = run_cli("selftest", "--only", "kernels", "--formulations", "gla", "--dtypes", "bfloat16", "--no-progress")
    assert result.returncode == 2 and "nothing to run" in result.stderr, result.stdout + result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_without_a_gpu_exits_2() -> None:
    result = run_cli("bench", "--formulations", "gla")
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr


# ----------------------------------------------------------------------------- results: 0 or 1

TINY = ("--shape", "1,1,8,8", "--seed", "3", "--device", "cpu")
HIDE_RETNET_KERNELS = "import sys\nsys.modules['attnlab.kernels.retnet'] = None  # importing it raises"


def test_report_exits_0_when_every_point_is_measured_and_1_when_one_raised(tmp_path: Path) -> None:
    args = ("report", "--formulations", "retnet", "--dtypes", "float32", "--lengths", "8", "--mpmath-check-max-T", "0",
            *TINY)
    result = run_cli(*args, "--out", str(tmp_path / "ok"))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "ok" / "report.json").read_text())["rows"]
    assert {r["verdict"] for r in rows} == {"held"}, rows
    assert "| verdict |" in (tmp_path / "ok" / "index.md").read_text()
    broken = run_cli(*args, "--out", str(tmp_path / "broken"), prelude=HIDE_RETNET_KERNELS)
    assert broken.returncode == 1, broken.stderr[-2000:]
    assert "raised: retnet attnlab:chunkwise float32: ModuleNotFoundError" in broken.stderr
    rows = json.loads((tmp_path / "broken" / "report.json").read_text())["rows"]
    assert {r["impl"]: r["verdict"] for r in rows} == {"attnlab:chunkwise": "failed", "attnlab:recurrent": "failed",
                                                       "fp32-recurrent": "held"}


def test_map_exits_1_when_a_point_raised(tmp_path: Path) -> None:
    args = ("map", "gate", "--formulations", "retnet", "--dtypes", "float16", "--lengths", "8", "--steps", "2", *TINY,
            "--out", str(tmp_path))
    result = run_cli(*args, prelude=HIDE_RETNET_KERNELS)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "raised: retnet attnlab:chunkwise float16" in result.stderr
    assert "held / imprecise / failed" in (tmp_path / "index.md").read_text()


def test_selftest_exits_0_when_its_specimen_is_caught_and_1_when_it_escapes() -> None:
    args = ("selftest", "--only", "specimens", "--formulations", "softmax", "--dtypes", "float16", "--examples", "8",
            "--jobs", "1", "--no-progress")
    result = run_cli(*args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "softmax_default_scale_one" in result.stdout and "caught" in result.stdout
    assert "float16: smallest defect" in result.stdout  # the excess extremes the correctness bound sits between
    not_broken = textwrap.dedent("""
        from attnlab.properties import specimens
        def correct(*, q, k, v, scale=None, causal=True):
            return specimens.softmax_default_scale_one(q=q, k=k, v=v, causal=causal,
                                                       scale=q.shape[-1] ** -0.5 if scale is None else scale)
        specimens.SPECIMENS = (specimens.Specimen("softmax_correct", "softmax", correct, "none", "matches_oracle"),)
    """)
    escaped = run_cli(*args, prelude=not_broken)
    assert escaped.returncode == 1, escaped.stdout[-3000:] + escaped.stderr[-2000:]
    assert "ESCAPED" in escaped.stdout and "1 runs, 1 failed" in escaped.stdout


# ----------------------------------------------------------------------------- verdicts: held, imprecise, failed

SCALED_KERNELS = '''
"""retnet as the float64 oracle times (1 + eps), rounded once to the input dtype: excess about eps / floor."""
import attnlab

_oracle = attnlab.oracle("retnet", "recurrent")


def _scaled(eps, x):
    return (_oracle(**x) * (1 + eps)).to(x["q"].dtype)


def exact(**x):
    return _scaled(0.0, x)


def fp16_imprecise(**x):  # fp16 floor ~ 2^-11 / sqrt(3) = 2.8e-4 on these outputs: excess ~ 8
    return _scaled({eps_imprecise!r}, x)


def wrong(**x):  # a 10% error: thousands of floors in fp16, millions in fp32
    return _scaled(0.1, x)
'''
# Excess of the fp16_imprecise kernel: eps / floor with the rounding floor of 16 or more Gaussian-like outputs
# (about 2^-11 / sqrt(3), within a factor of 2): placed at the geometric middle of fp16's two bounds.
FP16 = BOUNDS["float16"]
EPS_IMPRECISE = (FP16.accuracy * FP16.correctness) ** 0.5 * 2.0**-11 / 3**0.5
# One property on default inputs, K = V = 16 (16 outputs at least), no curve: a few seconds.
QUICK = ("--formulation", "retnet", "--convention", "attnlab", "--device", "cpu", "--strategy", "default",
         "--properties", "matches_oracle", "--examples", "4", "--dims", "16", "--max-T", "20", "--lengths", "none",
         "--minimize", "0", "--no-progress")


@pytest.fixture()
def scaled(tmp_path: Path) -> Path:
    (tmp_path / "scaled_kernels.py").write_text(textwrap.dedent(SCALED_KERNELS.format(eps_imprecise=EPS_IMPRECISE)))
    return tmp_path


def validate(folder: Path, kernel: str, dtype: str, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = folder / f"out-{kernel}-{dtype}-{len(options)}"
    result = run_cli("validate", "--kernel", f"scaled_kernels:{kernel}", "--dtype", dtype, *QUICK, *options,
                     "--out", str(out), cwd=folder)
    data = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return result, data


def verdict_of(data: dict) -> tuple[str, float, float, float]:
    (v,) = data["verdicts"]
    return v["status"], v["figure"], v["bound"], v["correctness"]


def test_an_exact_kernel_is_held(scaled: Path) -> None:
    result, data = validate(scaled, "exact", "float16")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    status, figure, bound, correctness = verdict_of(data)
    assert status == "held" and figure == pytest.approx(1.0, abs=1e-3)
    assert (bound, correctness) == (FP16.accuracy, FP16.correctness)
    assert data["verdict"] == "held" and data["held"] is True
    assert "verdict: PASS: all 1 property runs held" in result.stdout


def test_a_small_constant_error_is_imprecise_and_fails_only_under_strict(scaled: Path) -> None:
    result, data = validate(scaled, "fp16_imprecise", "float16")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    status, figure, bound, correctness = verdict_of(data)
    assert status == "imprecise" and bound < figure <= correctness, (figure, bound, correctness)
    assert data["verdict"] == "imprecise" and data["held"] is False and data["exit_code"] == 0
    assert " IMPRECISE " in result.stdout and "verdict: PASS with 1 imprecise of 1 property runs" in result.stdout
    assert "property matches_oracle IMPRECISE for scaled_kernels:fp16_imprecise in float16" in result.stdout
    strict, data = validate(scaled, "fp16_imprecise", "float16", "--strict")
    assert strict.returncode == 1, strict.stdout[-3000:]
    assert data["exit_code"] == 1 and data["strict"] is True
    assert "verdict: FAIL (--strict): 1 imprecise" in strict.stdout


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_an_error_above_the_correctness_bound_is_failed(scaled: Path, dtype: str) -> None:
    result, data = validate(scaled, "wrong", dtype)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    status, figure, _, correctness = verdict_of(data)
    assert status == "failed" and figure > correctness == BOUNDS[dtype].correctness
    assert " FAILED " in result.stdout
    assert "verdict: FAIL: 1 failed of 1 property runs (matches_oracle)" in result.stdout


def test_bound_replaces_the_accuracy_bound(scaled: Path) -> None:
    """--bound 0.5 makes even the oracle rounded once (excess exactly 1) imprecise; a loose bound holds the
    imprecise kernel; the correctness bound stays the registry's."""
    tight, data = validate(scaled, "exact", "float16", "--bound", "0.5")
    assert tight.returncode == 0, tight.stdout[-3000:] + tight.stderr[-2000:]
    assert verdict_of(data) == ("imprecise", pytest.approx(1.0, abs=1e-3), 0.5, FP16.correctness)
    assert data["bound"] == 0.5
    assert data["bounds"] == {"float16": {"accuracy": 0.5, "correctness": FP16.correctness}}
    strict, _ = validate(scaled, "exact", "float16", "--bound", "0.5", "--strict")
    assert strict.returncode == 1, strict.stdout[-3000:]
    loose, data = validate(scaled, "fp16_imprecise", "float16", "--bound", str(FP16.correctness))
    assert loose.returncode == 0 and verdict_of(data)[0] == "held", loose.stdout[-3000:]


def test_a_bench_training_step_resets_the_gradients_it_accumulates() -> None:
    from attnlab.commands.bench import forward_backward

    x = torch.randn(3, 4, requires_grad=True)
    step = forward_backward(lambda: (x * 2.0, None), [x])
    step()
    assert x.grad is not None and bool(x.grad.ne(0).all())
    first = x.grad.clone()
    step()  # the gradient reset first: the same gradient again, not twice it
    assert torch.equal(x.grad, first)


def test_a_training_steps_memory_floor_adds_the_cotangent_and_every_gradient() -> None:
    from attnlab.commands.bench import bytes_moved

    f = attnlab.formulation("gated_deltanet")
    x = {n: t.to(torch.bfloat16) for n, t in f.sample(B=1, T=8, H=2, K=4, V=4, seed=0).items()}
    out = torch.empty(1, 8, 2, 4, dtype=torch.bfloat16)
    inputs = 2 * (3 * 64 + 2 * 16)  # q, k, v [1, 8, 2, 4]; g, beta [1, 8, 2]; bf16
    assert bytes_moved(f, x, out, backward=False) == inputs + 128
    assert bytes_moved(f, x, out, backward=True) == inputs + 128 + 128 + inputs  # do read, every gradient written


def test_the_bench_table_gives_the_backward_in_forwards_where_both_passes_ran() -> None:
    from attnlab.commands.bench import markdown, with_backward_over_forward

    def row(name: str, timed_pass: str, ms: float) -> dict:
        return {"formulation": name, "setting": "default", "pass": timed_pass, "kernel": "k", "ours_ms": ms,
                "floor_ms": 0.5, "peer": None, "peer_ms": math.nan, "ratio": math.nan}

    rows = with_backward_over_forward([row("kda", "forward + backward", 3.5), row("kda", "forward", 1.0),
                                       row("gla", "forward + backward", 2.0)])
    assert rows[0]["backward_over_forward"] == 2.5
    assert "backward_over_forward" not in rows[1] and "backward_over_forward" not in rows[2]  # gla: no forward row
    table = [line for line in markdown(rows, {}).splitlines() if line.startswith("|")]
    assert table[0].endswith("| ours / floor | backward / forward |")
    assert table[2] == "| kda | forward + backward | `k` | 3.500 | none | n/a | n/a | 0.500 | 7.0 | 2.50 |"
    assert table[3].endswith("| 0.500 | 2.0 |  |") and table[4].endswith("| 4.0 |  |")


@pytest.mark.gpu
def test_bench_times_forward_and_training_steps_beside_the_peer_gpu(tmp_path: Path) -> None:
    result = run_cli("bench", "--formulations", "gla,kda", "--passes", "forward,backward", "-B", "1", "-T", "256",
                     "-H", "2", "-K", "64", "-V", "64", "--out", str(tmp_path / "bench.md"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = json.loads((tmp_path / "bench.json").read_text())["rows"]
    rows = {(r["formulation"], r["setting"], r["pass"]): r for r in table}
    for name in ("gla", "kda"):  # a gate per head and one per key channel
        forward, step = rows[(name, "default", "forward")], rows[(name, "default", "forward + backward")]
        assert 0 < forward["ours_ms"] < step["ours_ms"] and "error" not in step, step
        assert 0 < forward["floor_ms"] < step["floor_ms"]
        backward_ms = step["ours_ms"] - forward["ours_ms"]
        assert step["backward_over_forward"] == pytest.approx(backward_ms / forward["ours_ms"])
