"""The GPU job's logging of the property suite (tools/gpu/failure_log.py) and its replay of a logged case
(tools/gpu/fault_case.py), as a run on a lent GPU uses them, without the GPU: every worker's cases go to one file (the
device returns at most 8), and a line of it is what fault_case.py takes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))

import failure_log  # noqa: E402
import fault_case  # noqa: E402

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
