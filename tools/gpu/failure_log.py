"""A pytest plugin for the property suite on a lent GPU (``-p failure_log``, tools/gpu on the path): it writes what
pytest keeps to its end, as it happens, so that a run the device's limit kills still leaves it.

- ``$OUT/failures.log``: each failed test's report when it fails (pytest prints them only in its summary; with
  pytest-xdist the controller writes it).
- ``$OUT/cases.log``: each case a gradient check runs (attnlab.properties.checks.gradient_run), written before it
  runs, every worker's in the one file (the device returns at most 8 files: a file per worker of 14 would crowd out
  the logs); a tab-separated line: worker (gw0, ...; "main" without xdist), label, dtype, mode, chunk size, case. A
  worker's last line is the case it was on when the run was killed; for a CUDA fault, which the suite reports itself
  (unshrunk, as "CUDA FAULT", attnlab.properties.suite), it is the case that faulted, which tools/gpu/fault_case.py
  runs again alone (``awk -F'\\t' '$1 == "gw3"' $OUT/cases.log | tail -1``); with ``CUDA_LAUNCH_BLOCKING=1`` the
  failure's traceback names the launch. Each line is one write to a file opened for appending, so the workers' lines
  do not interleave.
"""

from __future__ import annotations

import functools
import os

import pytest

OUT = os.environ.get("OUT", ".")


def _log_cases() -> None:
    from attnlab.properties import checks

    run = checks.gradient_run
    path = os.path.join(OUT, "cases.log")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")

    @functools.wraps(run)
    def logged(target, case, dtype, device="cpu", mode="full", chunk_size=None):
        line = "\t".join((worker, target.label, str(dtype).removeprefix("torch."), mode, repr(chunk_size), repr(case)))
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, (line + "\n").encode())
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        return run(target, case, dtype, device, mode, chunk_size)

    checks.gradient_run = logged


def pytest_configure(config: pytest.Config) -> None:
    _log_cases()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        with open(os.path.join(OUT, "failures.log"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
