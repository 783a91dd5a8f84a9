"""The GPU job's logging of the property suite (tools/gpu/failure_log.py) and its replay of a logged case
(tools/gpu/fault_case.py), as a run on a lent GPU uses them, without the GPU: every worker's cases go to one file (the
device returns at most 8), a line of it is what fault_case.py takes, and a check's gradients run on one worker. And
tools/gpu/profile_launches.py's comparisons with other versions of a kernel module, as far as they go before a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))

import failure_log  # noqa: E402
import fault_case  # noqa: E402
import profile_launches  # noqa: E402

from attnlab.properties import checks  # noqa: E402
from attnlab.properties.strategies import Case  # noqa: E402


def _log_one_case(monkeypatch: pytest.MonkeyPatch, worker: str, case: Case, mode: str) -> list[tuple]:
    """Run the plugin's logging as worker ``worker`` would, on a stand-in for the gradient run; the calls it passed
    on."""
    calls: list[tuple] = []
    monkeypatch.setattr(checks, "gradient_run", lambda *args: calls.append(args) or "ran")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    failure_log._log_cases()
    target = SimpleNamespace(label="attnlab:gated_deltanet/chunkwise")
    assert checks.gradient_run(target, case, torch.bfloat16, "cuda", mode, None) == "ran"
    return calls


def test_every_worker_logs_its_cases_to_one_file_that_fault_case_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(failure_log, "OUT", str(tmp_path))
    first = Case(name="gated_deltanet", seed=194, B=2, T=527, H=1, K=119, V=127, gate_low=0.0, cut=526)
    second = Case(name="gated_deltanet", seed=3, T=9, K=5, V=3, cut=4)
    assert len(_log_one_case(monkeypatch, "gw0", first, "split")) == 1
    assert len(_log_one_case(monkeypatch, "gw1", second, "causal")) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["cases.log"]
    lines = (tmp_path / "cases.log").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["gw0", "gw1"]
    label, dtype, mode, chunk_size, case_text = fault_case.case_fields(lines[0])
    assert (label, dtype, mode, chunk_size) == ("attnlab:gated_deltanet/chunkwise", "bfloat16", "split", "None")
    assert eval(case_text) == first  # noqa: S307 - the plugin's own repr of a Case
    assert fault_case.case_fields(lines[1].split("\t", 1)[1])[2] == "causal"  # the line without its worker


def test_fault_case_names_the_format_of_a_line_it_cannot_read():
    with pytest.raises(SystemExit, match="worker, label, dtype, mode, chunk size, case"):
        fault_case.case_fields("gw3 attnlab:kda/chunkwise bfloat16 full None Case(name='kda')")


def test_a_checks_gradients_share_a_worker_and_its_long_sequence_variant_has_its_own(tmp_path):
    """The GPU job runs the suite with --dist loadgroup: one worker takes a check's gradients, which draw the same
    cases, so that one backward pass per case serves them all."""
    (tmp_path / "groups_plugin.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    for item in session.items:\n"
        "        mark = item.get_closest_marker('xdist_group')\n"
        "        print('GROUP', item.name, mark.args[0] if mark else None)\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "attnlab.properties", "--collect-only", "-q", "-s",
         "-p", "no:cacheprovider", "-p", "groups_plugin",
         "-k", "backward_matches_oracle and deltanet and chunkwise and not gated",
         "--attnlab-dtype", "bfloat16", "--attnlab-device", "cpu", "--attnlab-profile", "ci"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)
    groups = dict(line.split(" ")[1:] for line in result.stdout.splitlines() if line.startswith("GROUP "))
    assert len(groups) == 10, result.stdout + result.stderr  # dq, dk, dv, dbeta, d initial_state; twice
    short = {group for name, group in groups.items() if name.startswith("test_kernel_property[")}
    long = {group for name, group in groups.items() if name.startswith("test_kernel_property_long_sequences[")}
    assert short == {"backward_matches_oracle-attnlab:deltanet/chunkwise-bfloat16"}
    assert long == {"backward_matches_oracle-attnlab:deltanet/chunkwise-bfloat16-long"}


def test_the_gpu_jobs_property_step_runs_the_groups_on_their_workers():
    job = (Path(__file__).resolve().parents[1] / "tools" / "gpu" / "job").read_text()
    step = job.split("\n    properties)\n")[1].split(";;")[0]
    assert "--dist loadgroup" in step and "-p failure_log" in step


PROFILE_LAUNCHES = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "profile_launches.py"


def test_profile_launches_checks_every_alternative_before_its_first_run(tmp_path):
    # Each run of a comparison takes minutes of a lent GPU: a second --against that names no module must stop the
    # call before the first.
    alternative = tmp_path / "_delta_chunk_backward.py"
    alternative.write_text("")
    done = subprocess.run([sys.executable, str(PROFILE_LAUNCHES), "deltanet", "--backward", "--against",
                           str(alternative), f"--against={tmp_path / 'nosuch.py'}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and done.stderr.strip().endswith(f"--against {tmp_path / 'nosuch.py'}: no such file"), (
        done.stdout + done.stderr)
    assert "total" not in done.stdout


def test_profile_launches_runs_each_alternative_without_any_against():
    argv = ["deltanet,kda", "--against", "alt/a.py", "--backward", "--against=alt/b.py", "--no-peer"]
    assert profile_launches._without_against(argv) == ["deltanet,kda", "--backward", "--no-peer"]
