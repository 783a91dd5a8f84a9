"""``attnlab campaign``: usage errors, the plan drawn from the registry or a campaign file, pytest-xdist's workers
(pinned by their execnet specs), a whole campaign on the CPU on a small library with a correct and a broken
kernel (resumed, cut short, a worker crashing), and rendering.

The runs here are on the CPU (plain-torch kernels, CPU workers); on a GPU the same command pins one worker per
GPU (tools/gpu/job campaign).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.commands import campaign, campaign_report
from attnlab.commands.campaign import (KILL_GRACE, CampaignKernel, _worker_specs, library_for, plan_items, shipped_library,
                                       shipped_targets, worker_threads)
from attnlab.commands.validate import UsageError
from attnlab.properties import suite
from attnlab.properties.regressions import REGRESSIONS
from attnlab.properties.strategies import Case
from attnlab.properties.targets import Target, function_target, own_kernel_target, rounded_oracle_target
from attnlab.registry import REGISTRY, names

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_plugin import THIRD_PARTY_KERNELS  # noqa: E402 - the plugin tests' third-party GLA: good and stale_gate

# A kernel that kills the process running a campaign's item (a worker crash mid-campaign) and answers the campaign's
# probe of its convention, which runs in the command's own process before the items (campaign.PLAN_ENV is set for
# the items alone); keyed to the drawn length instead (T > 8), an item whose time ran out before a longer draw
# held, under CI's load. And one that is not differentiable.
CRASHING_KERNEL = f'''

def frozen(*, q, k, v, g, scale=None):
    import torch
    with torch.no_grad():
        return gla(q=q, k=k, v=v, g=g, scale=scale)

def crashes(*, q, k, v, g, scale=None):
    import os
    if os.environ.get({campaign.PLAN_ENV!r}):
        os._exit(3)
    return gla(q=q, k=k, v=v, g=g, scale=scale)
'''


def run(*argv: str) -> tuple[int, str, str]:
    """``attnlab campaign ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["campaign", *argv])
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def library(tmp_path: Path, *kernels: str, suffix: str = ".toml") -> Path:
    """A campaign file for the fake library ``mykernels.py`` (good, stale_gate, crashes), beside it."""
    (tmp_path / "mykernels.py").write_text(textwrap.dedent(THIRD_PARTY_KERNELS) + CRASHING_KERNEL)
    path = tmp_path / f"mylib{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"title": "mylib", "kernel": [
            {"formulation": "gla", "function": f"mykernels.py:{k}"} for k in kernels]}))
    else:
        path.write_text('title = "mylib"\n' + "".join(
            f'[[kernel]]\nformulation = "gla"\nfunction = "mykernels.py:{k}"\nconvention = "attnlab"\n' for k in kernels))
    return path


def campaign_run(tmp_path: Path, target: Path | str, *options: str) -> subprocess.CompletedProcess:
    """``attnlab campaign`` as a user runs it (a subprocess, on the CPU, two workers, small searches)."""
    command = [sys.executable, "-m", "attnlab.cli", "campaign", str(target), "--device", "cpu", "--workers", "2",
               "--dtypes", "float32", "--examples", "2", "--no-progress", *options]
    environ = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**environ, "CUDA_VISIBLE_DEVICES": ""})


def results(out: Path) -> dict[str, dict]:
    return campaign_report.read_results(out)


# ----------------------------------------------------------------------------- usage


@pytest.mark.parametrize("argv, message", [
    ((), "name a target: torch, fla, or a campaign file"),
    (("nosuch",), "unknown target 'nosuch'; known: torch, fla, or a campaign file"),
    (("missing.toml",), "campaign file missing.toml: no such file"),
    (("fla", "--device", "cpu", "--ops", "chunk_gla,nosuch"), "--ops 'chunk_gla,nosuch': expected some of parallel_attn"),
    (("fla", "--examples", "0"), "--examples, --workers and --workers-per-gpu at least 1"),
    (("fla", "--budget", "0"), "--budget and --item-budget must be positive"),
    (("fla", "--device", "cpu", "--dtypes", "float8"), "--dtypes 'float8': expected some of bfloat16, float16, float32"),
    (("fla", "--device", "cpu", "--dtypes", "bfloat16"), "--dtypes bfloat16 needs a GPU"),
    (("fla", "--device", "cpu", "--passes", "sideways"), "--passes 'sideways': expected some of forward, backward"),
    (("fla", "--device", "cpu", "--lengths", "0"), "--lengths '0': expected positive integers"),
    (("--render", "no/such/folder"), "--render no/such/folder: no campaign.json and no plan.json there"),
])
def test_usage_errors_exit_2(argv: tuple[str, ...], message: str) -> None:
    code, _, stderr = run(*argv)
    assert code == 2 and message in stderr, stderr


def test_the_help_shows_a_campaign_file_and_the_exit_statuses() -> None:
    result = subprocess.run([sys.executable, "-m", "attnlab.cli", "campaign", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0
    assert "[[kernel]]" in result.stdout and 'convention = "attnlab"' in result.stdout
    assert "Exit status: 0 every cell ran completely" in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without a GPU")
def test_asking_for_gpus_without_one_is_a_usage_error() -> None:
    code, _, stderr = run("fla", "--device", "cuda")
    assert code == 2 and "no CUDA GPU is visible here; use --device cpu" in stderr


@pytest.mark.parametrize("content, message", [
    ('title = "x"\n', "no [[kernel]] entries"),
    ('[[kernel]]\nformulation = "gla"\n', "kernel 1 has no function"),
    ('[[kernel]]\nformulation = "glaa"\nfunction = "m:f"\n', "kernel 1: unknown formulation 'glaa'"),
    ('[[kernel]]\nformulation = "gla"\nfunction = "m:f"\nconvention = "mine"\n', "kernel 1: convention 'mine'"),
    ('[[kernel]]\nformulation = "gla"\nfunction = "m:f"\n[[kernel]]\nformulation = "gla"\nfunction = "n:f"\n',
     "two kernels share a name (gla.f)"),
    ('[[kernel]\n', "campaign file"),
])
def test_a_bad_campaign_file_is_a_usage_error_saying_what_is_wrong(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(UsageError) as error:
        library_for(str(path))
    assert message in str(error.value)


def test_a_campaign_file_in_json_reads_like_toml(tmp_path: Path) -> None:
    toml, js = library_for(str(library(tmp_path, "good"))), library_for(str(library(tmp_path, "good", suffix=".json")))
    assert toml.kernels == js.kernels == (CampaignKernel("gla", f"{tmp_path / 'mykernels.py'}:good", "attnlab"),)


# ----------------------------------------------------------------------------- the plan


def test_the_shipped_targets_are_every_registry_peer_of_their_library() -> None:
    assert shipped_targets() == ["torch", "fla"]  # registry order: softmax's peers first
    for target in shipped_targets():
        kernels = shipped_library(target).kernels
        assert [k.function for k in kernels] == [p.function for f in REGISTRY for p in f.peers if p.library == target]
        assert all(k.convention == "peer" for k in kernels)
    torch_kernels = {k.op for k in shipped_library("torch").kernels}
    assert {"scaled_dot_product_attention", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math",
            "flex_attention_causal"} <= torch_kernels


def test_the_modules_never_name_a_formulation() -> None:
    for module in ("campaign.py", "campaign_report.py", "campaign_items.py"):
        tree = ast.parse((ROOT / "attnlab" / "commands" / module).read_text())
        strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not strings & set(names()), module


def test_every_cell_starts_before_any_goes_on_and_then_runs_in_a_row() -> None:
    kernels = [{"id": "a.f", "properties": {"default": {"matches_oracle": ["matches_oracle"], "q": ["q"],
                                                        "backward_r": ["backward_r[dq]", "backward_r[dk]"]}}},
               {"id": "b.g", "properties": {"default": {"matches_oracle": ["matches_oracle"]}}},
               {"id": "c.h", "error": "cannot be called"}]
    items = plan_items(kernels, ["float32", "float16"], ["default"], curve=True)
    cells = [(i["kernel"], i["dtype"]) for i in items]
    assert len(items) == 2 * 4 + 2 * 2 and ("c.h", "float32") not in cells
    first, second = {}, {}
    for n, cell in enumerate(cells):
        (second if cell in first else first).setdefault(cell, n)
    assert max(first.values()) < min(second.values())  # every cell's first item before any cell's second
    assert all(items[n]["property"] == "matches_oracle" for n in first.values())
    rest = items[len(first):]
    assert [i["property"] for i in rest[:3]] == ["curve", "q", "backward_r"]  # the curve leads the rest of a cell
    order = [(i["kernel"], i["dtype"]) for i in rest]
    assert order == sorted(order, key=order.index)  # each cell's rest in a row
    backward = next(i for i in items if i["property"] == "backward_r")
    assert backward["judges"] == ["backward_r[dq]", "backward_r[dk]"] and backward["pass"] == "backward"
    assert backward["key"] == "a.f/float32/default/backward_r"


class _Config:
    """What pytest-xdist's LoadScheduling reads of pytest's config: the workers' specs and the chunk cap."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def getvalue(self, name: str) -> list[str]:
        assert name == "tx"
        return [f"{self.workers}*popen"]

    def getoption(self, name: str) -> None:
        assert name == "maxschedchunk"


class _Worker:
    """A pytest-xdist worker as the scheduler sees it: the items it is sent."""

    shutting_down = False

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_each_worker_is_sent_one_cell_at_a_time_every_cell_started_first() -> None:
    """Four cells of six items over three workers (the plan's order: every cell's first, then the rests): each
    worker's first batch is one cell's, the three cells first in the plan start at once, the fourth goes to the
    first worker to run low before anyone gets more of a started cell, and a dead worker's items are re-queued."""
    from attnlab.commands.campaign_schedule import CellScheduling, cell_lookup

    items = [{"key": f"k{c}.f/float32/default/p{n}", "kernel": f"k{c}.f", "dtype": "float32"}
             for n in range(6) for c in range(4)]
    items = items[:4] + sorted(items[4:], key=lambda i: i["kernel"])  # firsts, then each cell's rest in a row
    collection = [f"campaign_items.py::test_item[{campaign_report.node_id(i['key'])}]" for i in items]
    cell_of = cell_lookup(items)
    scheduler = CellScheduling(_Config(3), None, cell_of)
    workers = [_Worker(f"gw{n}") for n in range(3)]
    for w in workers:
        scheduler.add_node(w)
        scheduler.add_node_collection(w, collection)
    scheduler.schedule()
    cells = [{cell_of(collection[i]) for i in w.sent} for w in workers]
    assert cells == [{"k0.f/float32"}, {"k1.f/float32"}, {"k2.f/float32"}], cells
    first, sent = workers[0], len(workers[0].sent)
    for index in list(first.sent):
        scheduler.mark_test_complete(first, index)
    assert {cell_of(collection[i]) for i in first.sent[sent:]} == {"k3.f/float32"}  # the unstarted cell
    crashed = scheduler.remove_node(workers[1])  # its first item was running: the rest goes back to pending
    assert crashed == collection[workers[1].sent[0]]
    assert set(workers[1].sent[1:]) <= set(scheduler.pending) | {i for w in (workers[0], workers[2]) for i in w.sent}


def test_gpu_workers_are_pinned_in_their_execnet_specs_and_cpu_workers_counted() -> None:
    assert _worker_specs("cuda", 2, 2, 0) == ["--dist=load"] + [f"--tx=popen//env:CUDA_VISIBLE_DEVICES={g}"
                                                                   for g in (0, 0, 1, 1)]
    assert _worker_specs("cpu", 0, 1, 3) == ["--numprocesses=3", "--dist=load"]


def test_workers_share_the_cores_unless_the_user_set_the_thread_count() -> None:
    cores = len(os.sched_getaffinity(0))
    assert worker_threads(1, {}) == {"OMP_NUM_THREADS": str(cores)}
    assert worker_threads(cores + 1, {}) == {"OMP_NUM_THREADS": "1"}  # never none
    assert worker_threads(2, {"OMP_NUM_THREADS": "3"}) == {}  # the user's choice stands


def test_an_execnet_spec_sets_the_workers_environment_before_the_tests_import_anything(tmp_path: Path) -> None:
    """The mechanism that pins a GPU: each worker's CUDA_VISIBLE_DEVICES is its spec's, already at import time
    (before torch could start CUDA)."""
    (tmp_path / "test_pinned.py").write_text(textwrap.dedent("""
        import os
        AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")

        def test_seen():
            with open(os.environ["PYTEST_XDIST_WORKER"] + ".seen", "w") as out:
                out.write(str(AT_IMPORT))
    """))
    specs = _worker_specs("cuda", 2, 1, 0)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider", *specs,
                           "test_pinned.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {p.stem: p.read_text() for p in tmp_path.glob("gw*.seen")}
    assert set(seen.values()) <= {"0", "1"} and seen, seen
    for worker, value in seen.items():
        assert value == worker[2:], seen  # gw0 on GPU 0, gw1 on GPU 1


def _declining(declines: Callable[[int], bool]) -> Target:
    """The ideal retnet kernel, declining (NotImplementedError, as a pinned SDPA backend without a kernel does)
    every input whose T ``declines``."""
    ideal = rounded_oracle_target("retnet")

    def kernel(**x):
        if declines(x["q"].shape[1]):
            raise NotImplementedError(f"no kernel for T = {x['q'].shape[1]}")
        return ideal.function(**x)

    return function_target(kernel, "retnet", "declines")


def test_inputs_a_kernel_declines_are_skipped_and_counted_and_declining_all_is_refused() -> None:
    from attnlab.commands.validate import examples_text, run_property
    from attnlab.conventions import ATTNLAB

    sizes = suite.sizes_for("cpu", "ci")
    prop = next(p for p in suite.applicable(_declining(lambda T: T == 1)) if p.name == "matches_oracle")
    some = run_property(prop, _declining(lambda T: T == 1), __import__("torch").float32, "cpu", sizes, "default", 6,
                        ATTNLAB, None, 0)
    assert some.status == "held" and some.declined >= 1 and some.examples == 6, some
    assert examples_text(some) == f"6 (+{some.declined} declined)"
    every = run_property(prop, _declining(lambda T: True), __import__("torch").float32, "cpu", sizes, "default", 6,
                         ATTNLAB, None, 0)
    assert every.status == "refused" and "no kernel for T = " in every.detail, every
    hurried = run_property(prop, _declining(lambda T: True), __import__("torch").float32, "cpu", sizes, "default", 6,
                           ATTNLAB, None, 0, deadline=time.monotonic())
    assert hurried.status == "refused" and hurried.declined == 1  # past its budget, declined draws stop too
    assert campaign_report.classify({**asdict(every), "measure": every.measure})[0] == "limitation"


def test_a_cuda_fault_ends_the_search_on_the_case_that_faulted_and_later_searches_do_not_run(monkeypatch) -> None:
    import torch
    from attnlab.properties import checks

    monkeypatch.setattr(suite, "_LOST", [])  # this process's record of a lost context, left as it was
    ideal = rounded_oracle_target("retnet")
    calls = []

    def kernel(**x):
        calls.append(x["q"].shape[1])
        if len(calls) >= 3:  # the third call faults, and every call after it, as on a lost CUDA context
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return ideal.function(**x)

    target = function_target(kernel, "retnet", "faults")
    properties = {p.name: p for p in suite.applicable(target)}
    sizes = suite.sizes_for("cpu", "ci")
    outcome = suite.run(properties["matches_oracle"], target, torch.float32, "cpu", sizes)
    assert outcome.failure is outcome.cuda_fault and checks.is_cuda_fault(outcome.failure), outcome
    assert len(calls) == 3 and outcome.first_failure == 3  # no call after the fault: nothing shrunk
    assert suite.lost_context() is not None and suite.lost_context().result is outcome.cuda_fault
    later = suite.run(properties["causality"], target, torch.float32, "cpu", sizes)
    assert later.verdict == "error" and later.errors[0].startswith("AssertionError: NOT RUN: "), later
    assert "matches_oracle on faults in float32" in later.errors[0] and len(calls) == 3


def test_validate_does_not_minimize_a_cuda_fault(monkeypatch) -> None:
    import torch
    from attnlab.commands.validate import run_property
    from attnlab.conventions import ATTNLAB

    monkeypatch.setattr(suite, "_LOST", [])
    ideal = rounded_oracle_target("retnet")
    calls = []

    def kernel(**x):
        calls.append(x["q"].shape[1])
        if len(calls) >= 3:  # the first two draws (the smallest) pass; the third faults, and every call after it
            raise RuntimeError("CUDA error: unspecified launch failure")
        return ideal.function(**x)

    target = function_target(kernel, "retnet", "faults")
    prop = next(p for p in suite.applicable(target) if p.name == "matches_oracle")
    verdict = run_property(prop, target, torch.float32, "cpu", suite.sizes_for("cpu", "ci"), "default", 6, ATTNLAB,
                           None, 20)
    assert verdict.status == "failed" and verdict.minimize_checks == 0 and len(calls) == 3, (verdict, calls)
    assert verdict.case == verdict.found and calls[-1] > 1  # reported as drawn, not the smallest case


def test_a_kernels_draws_do_not_depend_on_the_folder_its_file_lies_in() -> None:
    # Seen in CI: the seed was keyed on the kernel's absolute path, so a campaign in pytest's next tmp folder drew
    # other cases, and two examples missed stale_gate's bug.
    ideal = rounded_oracle_target("retnet")
    prop = next(p for p in suite.applicable(ideal) if p.name == "matches_oracle")
    from hypothesis import settings

    def drawn(label: str) -> list[tuple]:
        cases: list[tuple] = []

        def kernel(**x):
            cases.append((tuple(x["q"].shape), float(x["q"].sum())))
            return ideal.function(**x)

        outcome = suite.run(prop, function_target(kernel, "retnet", label), __import__("torch").float32, "cpu",
                            suite.sizes_for("cpu", "ci"), settings(max_examples=4, database=None, derandomize=True,
                                                                   deadline=None), regressions=False)
        assert not outcome.errors and outcome.failure is None, outcome
        return cases

    here = drawn("/tmp/pytest-of-root/pytest-236/popen-gw1/campaign0/mykernels.py:stale_gate")
    assert here == drawn("/home/someone/lab/mykernels.py:stale_gate") == drawn("mykernels.py:stale_gate")
    assert here != drawn("mykernels.py:good")  # the function still seeds it
    assert suite.portable_label("attnlab:chunkwise") == "attnlab:chunkwise"


def test_a_search_past_its_deadline_runs_the_replayed_cases_and_one_more_then_stops() -> None:
    target = own_kernel_target("retnet", "recurrent")
    prop = next(p for p in suite.applicable(target) if p.name == "matches_oracle")
    replayed = [Case(name="retnet", seed=s, T=3, H=1, K=16, V=16) for s in (1, 2)]
    from hypothesis import settings

    outcome = suite.run(prop, target, __import__("torch").float32, "cpu", suite.sizes_for("cpu", "ci"),
                        settings(max_examples=50, database=None, derandomize=True, deadline=None),
                        replay=replayed, deadline=time.monotonic())
    assert outcome.budget_spent and outcome.examples == len(replayed) + 1, outcome


def test_the_result_that_finished_last_wins_whatever_the_file(tmp_path: Path) -> None:
    # A resumed run's workers append to their own files: the stale "not run" of an item may sit in a file read after
    # the one holding its newer result (gw5.jsonl after gw12.jsonl, seed.jsonl after both).
    folder = tmp_path / "results"
    folder.mkdir()
    stale = {"key": "k/bfloat16/default/p", "status": "not run", "finished": "2026-11-26T01:45:00+0000"}
    newer = {**stale, "status": "held", "finished": "2026-11-26T01:50:00+0000"}
    other = {"key": "j/bfloat16/default/p", "status": "failed", "finished": "2026-11-26T01:40:00+0000"}
    (folder / "gw12.jsonl").write_text(json.dumps(newer) + "\n")
    (folder / "gw5.jsonl").write_text(json.dumps(stale) + "\n" + json.dumps(other) + "\n{\"cut off")
    assert {k: r["status"] for k, r in results(tmp_path).items()} == {"k/bfloat16/default/p": "held",
                                                                      "j/bfloat16/default/p": "failed"}


def test_a_search_whose_kept_cases_spend_the_budget_ends_there_without_an_error() -> None:
    # Seen on the GPU: a kernel's first call compiled through the item budget inside the kept regressions, and the
    # search, rejecting every draw after them, ended Unsatisfiable (recorded as an error).
    target = own_kernel_target("softmax", "chunkwise")
    prop = next(p for p in suite.applicable(target) if p.name == "matches_oracle")
    kept = [c for c in REGRESSIONS["matches_oracle"] if prop.fits(target, c)]
    assert kept, "needs a kept softmax regression"
    from hypothesis import settings

    outcome = suite.run(prop, target, __import__("torch").float32, "cpu", suite.sizes_for("cpu", "ci"),
                        settings(max_examples=50, database=None, derandomize=True, deadline=None),
                        deadline=time.monotonic())
    assert not outcome.errors and outcome.budget_spent and outcome.examples == len(kept), outcome


# ----------------------------------------------------------------------------- a whole campaign on the CPU


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A campaign of the fake library (a correct GLA and one with a stale gate), forward and backward."""
    tmp_path = tmp_path_factory.mktemp("campaign")
    done = campaign_run(tmp_path, library(tmp_path, "good", "stale_gate"), "--out", "out", "--lengths", "16")
    return tmp_path, done


def test_a_campaign_judges_every_item_and_fails_only_the_broken_kernel(finished) -> None:
    tmp_path, done = finished
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    plan = json.loads((out / "plan.json").read_text())
    stored = results(out)
    assert set(stored) == {i["key"] for i in plan["items"]}  # every item has its line
    assert {r["worker"] for r in stored.values()} == {"gw0", "gw1"}  # spread over both workers
    # Each worker gets its share of the cores as torch's CPU threads, not one thread per core each.
    cores = len(os.sched_getaffinity(0))
    assert {r["cpu_threads"] for r in stored.values()} == {max(1, cores // 2)}
    # Each worker started on a cell of its own (attnlab.commands.campaign_schedule): its file's first line.
    first_cells = {json.loads(path.read_text().splitlines()[0])["kernel"]
                   for path in (out / "results").glob("gw*.jsonl")}
    assert first_cells == {"gla.good", "gla.stale_gate"}, first_cells
    good = [r for r in stored.values() if r["kernel"] == "gla.good"]
    assert good and all(r["status"] == "held" for r in good), [r for r in good if r["status"] != "held"]
    assert any(r["property"] == "backward_matches_oracle" for r in good)  # differentiable: judged backward too
    broken = {r["property"]: r for r in stored.values() if r["kernel"] == "gla.stale_gate" and r["strategy"] == "default"}
    assert broken["matches_oracle"]["status"] == "failed"
    gradients = {v["property"]: v["status"] for v in broken["backward_matches_oracle"]["verdicts"]}
    assert gradients == {"backward_matches_oracle[dq]": "failed", "backward_matches_oracle[dk]": "failed",
                         "backward_matches_oracle[dv]": "failed", "backward_matches_oracle[dg]": "failed"}
    assert broken["causality"]["status"] == "held"  # its defect is not a causality violation
    # Findings are printed as they land, one line per verdict row.
    findings = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "IMPRECISE", "ERROR"))]
    assert any(line.startswith("FAILED: gla.stale_gate float32 default matches_oracle: ") for line in findings)
    assert any(line.startswith("FAILED: gla.stale_gate float32 default backward_matches_oracle[dg]: ") for line in findings)
    assert not [line for line in findings if "gla.good" in line]
    assert "2 cells: 1 held, 1 failed" in done.stdout


def test_the_report_has_a_summary_row_per_cell_and_a_section_per_kernel(finished) -> None:
    tmp_path, _ = finished
    text = (tmp_path / "out" / "campaign.md").read_text()
    assert text.startswith("# mylib under `attnlab campaign`")
    assert "on pytest-xdist" in text and f"2 CPU worker(s), {max(1, len(os.sched_getaffinity(0)) // 2)} CPU thread(s) each" in text
    assert "| gla | `good` | float32 | held | held | held |" in text
    assert "| gla | `stale_gate` | float32 | failed |" in text
    assert "## gla: `good`" in text and "## gla: `stale_gate`" in text and "### Excess by length" in text
    assert "| default | float32 | backward_matches_oracle[dg] | **FAILED** |" in text
    assert "## Reproducing the bugs" in text and "### stale_gate: matches_oracle (" in text


def test_a_reproducer_from_the_report_runs_and_fails_as_reported(finished) -> None:
    tmp_path, _ = finished
    text = (tmp_path / "out" / "campaign.md").read_text()
    # One reproducer per property and kernel: the first failing strategy's, default or adversarial (both find the stale
    # gate; which comes first follows the order the workers finished them).
    script = text.split("### stale_gate: matches_oracle (")[1].split("```python\n")[1].split("```")[0]
    (tmp_path / "repro.py").write_text(script)
    done = subprocess.run([sys.executable, "repro.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "FAILED" in done.stdout, done.stdout + done.stderr


def test_a_rerun_skips_what_is_done(finished) -> None:
    tmp_path, first = finished
    again = campaign_run(tmp_path, "mylib.toml", "--out", "out", "--lengths", "16")
    assert again.returncode == 1
    assert "0 to run" in again.stdout and "2 cells: 1 held, 1 failed" in again.stdout


def test_a_resumed_campaign_runs_what_is_missing_and_replays_stored_counterexamples_first(tmp_path: Path) -> None:
    path = library(tmp_path, "stale_gate")
    first = campaign_run(tmp_path, path, "--out", "out", "--lengths", "none", "--passes", "forward")
    assert first.returncode == 1, first.stdout + first.stderr
    out = tmp_path / "out"
    kept = [line for line in (out / "results" / "gw0.jsonl").read_text().splitlines()
            + (out / "results" / "gw1.jsonl").read_text().splitlines()]
    cut = "gla.stale_gate/float32/adversarial/matches_oracle"
    for worker in ("gw0", "gw1"):  # a run cut short: that item's line never landed
        (out / "results" / f"{worker}.jsonl").write_text("".join(
            line + "\n" for line in kept if json.loads(line)["key"] != cut and f'"worker": "{worker}"' in line))
    resumed = campaign_run(tmp_path, path, "--out", "out", "--lengths", "none", "--passes", "forward")
    assert "1 to run" in resumed.stdout, resumed.stdout
    verdict = results(out)[cut]["verdicts"][0]
    assert verdict["status"] == "failed" and verdict["first_failure"] == 1  # the stored default-strategy case, first


def test_a_campaign_cut_by_its_budget_says_which_items_did_not_run_and_why(tmp_path: Path) -> None:
    done = campaign_run(tmp_path, library(tmp_path, "good"), "--out", "out", "--budget", "0.001", "--lengths", "none",
                        "--passes", "forward")
    assert done.returncode == 1
    summary = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert summary["items"] and all(i["status"] == "not run" for i in summary["items"])
    assert "not started: the campaign's budget of 0.001 s was spent" in summary["items"][0]["detail"]
    text = (tmp_path / "out" / "campaign.md").read_text()
    assert "| gla | `good` | float32 | not run |" in text and "the campaign's budget of 0.001 s was spent" in text


def test_items_without_a_result_when_the_campaign_is_stopped_say_so_not_an_earlier_runs_reason(tmp_path: Path) -> None:
    # Seen on the GPU: items killed at a resumed run's stop kept the earlier run's "not started" reason, and the
    # progress printed that stale record as this run's finding.
    def item(prop: str) -> dict:
        return {"kernel": "gla.hangs", "dtype": "float32", "strategy": "default", "property": prop, "pass": "forward",
                "key": f"gla.hangs/float32/default/{prop}"}

    todo = [item("matches_oracle"), item("causality")]
    (tmp_path / "results").mkdir()
    earlier = {**todo[0], "status": "not run", "detail": "not started: an earlier run's reason",
               "finished": "2020-01-01T00:00:00+0000"}
    landed = {**todo[1], "status": "held", "finished": "2030-01-01T00:00:00+0000"}
    (tmp_path / "results" / "seed.jsonl").write_text(json.dumps(earlier) + "\n")
    (tmp_path / "results" / "gw0.jsonl").write_text(json.dumps(landed) + "\n")
    since = "2026-01-01T00:00:00+0000"
    assert campaign._follow(tmp_path, {i["key"] for i in todo}, set(), __import__("tqdm").tqdm(disable=True), since) \
        == {todo[1]["key"]}
    campaign.record_stopped(tmp_path, {"budget_s": 60, "item_budget_s": 15}, todo, since)
    stored = results(tmp_path)
    assert stored[todo[0]["key"]]["detail"].startswith(
        f"stopped: no result when the campaign was stopped {60 + 15 + KILL_GRACE:g} s after its first item")
    assert stored[todo[1]["key"]]["status"] == "held"


def test_past_its_budget_an_item_judges_every_gradient_on_the_draws_of_the_first(tmp_path: Path) -> None:
    done = campaign_run(tmp_path, library(tmp_path, "good"), "--out", "out", "--lengths", "none", "--passes", "backward",
                        "--strategies", "default", "--item-budget", "0.001", "--examples", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    items = json.loads((tmp_path / "out" / "campaign.json").read_text())["items"]
    judged = [i for i in items if len(i["verdicts"]) > 1]
    assert judged
    for item in judged:
        first, *others = item["verdicts"]
        assert first["budget_spent"] and first["examples"] < 4, first
        assert all(v["examples"] == first["examples"] and not v["budget_spent"] for v in others), item["verdicts"]


def test_a_worker_that_crashes_costs_its_item_not_the_campaign(tmp_path: Path) -> None:
    done = campaign_run(tmp_path, library(tmp_path, "crashes", "good"), "--out", "out", "--lengths", "none",
                        "--passes", "forward", "--strategies", "default")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "campaign.json").read_text())
    crashed = [i for i in summary["items"] if i["kernel"] == "gla.crashes"]
    assert crashed and all(i["status"] == "failed" and "the process running this item died" in i["detail"]
                           and "crashed while running" in i["detail"] for i in crashed), crashed
    again = campaign_run(tmp_path, "mylib.toml", "--out", "out", "--lengths", "none", "--passes", "forward",
                         "--strategies", "default")
    assert "0 to run" in again.stdout  # a crash is a result: a re-run does not crash on it again
    assert all(i["status"] == "held" for i in summary["items"] if i["kernel"] == "gla.good")
    text = (tmp_path / "out" / "campaign.md").read_text()
    assert "Bug: the kernel crashed the process running it" in text


def test_the_backward_items_of_a_kernel_that_is_not_differentiable_do_not_apply(tmp_path: Path) -> None:
    done = campaign_run(tmp_path, library(tmp_path, "frozen"), "--out", "out", "--lengths", "none",
                        "--strategies", "default")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "campaign.json").read_text())
    backward = [i for i in summary["items"] if i["pass"] == "backward"]
    assert backward and all(i["status"] == "not applicable" for i in backward)
    assert all(i["status"] == "held" for i in summary["items"] if i["pass"] == "forward")
    assert "NOT APPLICABLE" not in done.stdout  # not a finding
    text = (tmp_path / "out" / "campaign.md").read_text()
    assert "| gla | `frozen` | float32 | held |" in text and "its backward items do not apply" in text


def test_rendering_a_folder_cut_off_before_its_summary_reads_the_plan_and_results(finished, tmp_path: Path) -> None:
    source, _ = finished
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(source / "out"), str(copy)], check=True)
    (copy / "campaign.json").unlink()
    (tmp_path / "found.md").write_text("## What this campaign found\n\nstale_gate decays by the previous gate.\n")
    code, stdout, _ = run("--render", str(copy), "--report", str(tmp_path / "r.md"), "--preface", str(tmp_path / "found.md"))
    assert code == 1 and "2 cells: 1 held, 1 failed" in stdout
    text = (tmp_path / "r.md").read_text()
    assert "| gla | `stale_gate` | float32 | failed |" in text
    assert text.index("## What this campaign found") < text.index("## Summary")
    code, _, stderr = run("--render", str(copy), "--preface", str(tmp_path / "missing.md"))
    assert code == 2 and "--preface" in stderr and "no such file" in stderr


def test_rendering_results_merged_from_another_run_counts_them_with_the_runs_kept(finished, tmp_path: Path) -> None:
    # Folders merge by copying their results/ together (README): the render reads them, not the older campaign.json.
    source, _ = finished
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(source / "out"), str(copy)], check=True)
    runs = json.loads((copy / "campaign.json").read_text())["runs"]
    failed = next(r for r in results(copy).values() if r["status"] == "failed")
    later = {**failed, "status": "held", "worker": "other-host", "finished": "2999-01-01T00:00:00+0000",
             "verdicts": [{**v, "status": "held"} for v in failed.get("verdicts", [])]}
    (copy / "results" / "other-host.jsonl").write_text(json.dumps(later) + "\n")
    before = (copy / "campaign.md").read_text().count("FAILED")
    run("--render", str(copy))
    summary = json.loads((copy / "campaign.json").read_text())
    assert summary["runs"] == runs and next(i for i in summary["items"] if i["key"] == failed["key"])["status"] == "held"
    assert (copy / "campaign.md").read_text().count("FAILED") < before


# ----------------------------------------------------------------------------- rendering hand-made summaries


def summary(*items: dict, kernels: list[dict] | None = None, strict: bool = False) -> dict:
    return {"title": "fla", "distribution": "fla-core", "versions": {"fla-core": "0.6.0"}, "env": {},
            "device": {"type": "cuda", "name": "NVIDIA H100"}, "dtypes": ["bfloat16"], "strategies": ["default"],
            "passes": ["forward", "backward"], "examples": 4, "item_budget_s": 20, "budget_s": 500, "sizes": {},
            "dims": [64], "minimize": 12, "lengths": [], "curve_shape": {}, "strict": strict, "command": "attnlab campaign fla",
            "calling": "", "kernels": kernels or [{"id": "gla.chunk_gla", "op": "chunk_gla", "formulation": "gla",
                                                   "function": "fla.ops:chunk_gla", "convention": "peer"}],
            "items": list(items), "runs": [{"items": len(items), "seconds": 12.0, "workers": "2 GPU(s) x 4 worker(s)"}]}


def item(prop: str, status: str, *verdicts: dict) -> dict:
    return {"kernel": "gla.chunk_gla", "dtype": "bfloat16", "strategy": "default", "property": prop, "status": status,
            "verdicts": list(verdicts)}


def row(prop: str, status: str, figure: float | None = None, bound: float = 1.5, detail: str = "",
        measure: str = "excess = rel_err / floor") -> dict:
    return {"strategy": "default", "dtype": "bfloat16", "property": prop, "status": status, "examples": 4,
            "figure": figure, "bound": bound, "correctness": 8.0, "measure": measure, "case": "", "found": "",
            "detail": detail, "figure_text": "" if figure is None else f"{figure:.3g} / {bound:.3g} (excess)"}


def test_a_refused_backward_renders_refused_with_the_kernels_message_and_fails(tmp_path: Path) -> None:
    message = "chunk_gla's backward is disabled on this GPU"
    data = summary(item("matches_oracle", "held", row("matches_oracle", "held", 1.2)),
                   item("backward_matches_oracle", "refused",
                        row("backward_matches_oracle[dq]", "refused", detail=message, measure="the kernel's backward raised")))
    assert campaign_report.render(data, tmp_path / "r.md") == 1
    text = (tmp_path / "r.md").read_text()
    assert "1 held, 1 refused (backward)" in text and "**REFUSED**" in text and message in text
    assert "Does not apply: the kernel refuses its backward" in text
    assert "runs: 2 items in 12 s on 2 GPU(s) x 4 worker(s)" in text


@pytest.mark.parametrize("strict", [False, True])
def test_an_imprecise_cell_passes_unless_strict(tmp_path: Path, strict: bool) -> None:
    data = summary(item("matches_oracle", "imprecise", row("matches_oracle", "imprecise", 2.1)), strict=strict)
    assert campaign_report.render(data, tmp_path / "r.md") == (1 if strict else 0)
    text = (tmp_path / "r.md").read_text()
    assert "| gla | `chunk_gla` | bfloat16 | imprecise | 1 imprecise (worst 2.1; held <= 1.5, failed > 8) |" in text


def test_cells_incomplete_not_run_and_uncallable_each_say_so(tmp_path: Path) -> None:
    broken = {"id": "gla.fused_recurrent_gla", "op": "fused_recurrent_gla", "formulation": "gla",
              "function": "fla.ops:fused_recurrent_gla", "convention": "peer", "error": "ImportError: no fla"}
    ok = {"id": "gla.chunk_gla", "op": "chunk_gla", "formulation": "gla", "function": "fla.ops:chunk_gla", "convention": "peer"}
    data = summary(item("matches_oracle", "held", row("matches_oracle", "held", 1.1)),
                   {**item("causality", "not run"), "detail": "no result: worker 'gw1' crashed"},
                   kernels=[ok, broken])
    assert campaign_report.render(data, tmp_path / "r.md") == 1
    text = (tmp_path / "r.md").read_text()
    assert "2 cells: 1 incomplete, 1 error" in text
    assert "| gla | `chunk_gla` | bfloat16 | incomplete |" in text and "worker 'gw1' crashed" in text
    assert "Could not be called: ImportError: no fla" in text


def detail_row(prop: str, figure: float | None, detail: str, measure: str = "gradient excess = rel_err / floor") -> dict:
    return {"status": "failed", "property": prop, "strategy": "default", "dtype": "bfloat16", "figure": figure,
            "bound": 1.5, "measure": measure, "detail": detail}


@pytest.mark.parametrize("row, kind, words", [
    (detail_row("backward_matches_oracle[dq]", None, "dq: rel_err inf, max_err inf, floor_round 0.000e+00, "
                "floor_cond 0.000e+00 (computed only when needed), non-finite entries 0 of 64"),
     "representable", "the exact value is zero here"),
    (detail_row("matches_oracle", None, "NaN or inf in o; rel_err nan, floor_round 1.6e-03, non-finite entries 3 of 64",
                "excess = rel_err / floor"), "bug", "non-finite output"),
    (detail_row("backward_matches_oracle[dbeta]", 38.3, "dbeta: rel_err 6.628e-03, max_err 6.628e-03, floor_round "
                "1.732e-04, floor_cond 1.201e-07, non-finite entries 0 of 1"), "accuracy", "the error itself is 0.85 ulps"),
    (detail_row("backward_matches_oracle[dq]", 38.3, "dq: rel_err 6.6e-02, max_err 6.6e-02, floor_round 1.7e-03, "
                "floor_cond 1.2e-07, non-finite entries 0 of 4096"), "bug", "25.5x the bound"),
    # A stale gate's minimal counterexample (T = 2, K = V = 1): an exactly representable output, or two entries whose
    # rounding floor is luck, and an error of dozens of ulps: a bug all the same.
    (detail_row("matches_oracle", 4.1e5, "o: rel_err 5.0e-02, max_err 5.0e-02, floor_round 0.000e+00, non-finite "
                "entries 0 of 2", "excess = rel_err / floor"), "bug",
     "the exact output is representable in bfloat16 and fla"),
    (detail_row("matches_oracle", 0.4, "o: rel_err 6.0e-03, max_err 6.0e-03, floor_round 0.000e+00, non-finite "
                "entries 0 of 2", "excess = rel_err / floor"), "representable", "so any rounding shows"),
    (detail_row("backward_matches_oracle[dg]", 2.0e3, "dg: rel_err 2.0e-01, max_err 2.0e-01, floor_round 1.0e-04, "
                "floor_cond 1.2e-07, non-finite entries 0 of 2"), "bug", "x the bound"),
    (detail_row("split_and_resume", None, "returned o in float32, expected the input dtype bfloat16", "excess"),
     "contract", "returned o in float32"),
    (detail_row("backward_causality[dq]", 3.0, "4 entries of dq at positions >= 2 are not exactly zero",
                "gradient entries at positions >= cut not zero"), "bug", "causality is an identity"),
    (detail_row("backward_causality[dq]", 3.0, "dq: rel_err 5e-03, floor_round 1.7e-03, non-finite entries 0 of 128; "
                "do zero from position 2 of 3"), "accuracy", "less accurate than the bound on the default inputs"),
])
def test_failures_are_classified_by_what_they_say_about_the_kernel(row: dict, kind: str, words: str) -> None:
    found, why = campaign_report.classify(row, "fla")
    assert found == kind and words in why, (found, why)
