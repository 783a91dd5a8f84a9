"""``attnlab campaign``: the property suite on every kernel of a library, as pytest items spread by pytest-xdist.

    attnlab campaign TARGET [--gpus N|all] [--workers-per-gpu N] [--workers N] [--device cpu|cuda]
                            [--budget S] [--item-budget S] [--examples N] [--dtypes a,b] [--strategies a,b]
                            [--passes forward,backward] [--ops a,b] [--lengths a,b|none] [--strict] [--fresh] [--out DIR]
    attnlab campaign --render DIR [--report PATH] [--strict]     (re-render a results folder, anywhere)

TARGET is a library whose conventions attnlab ships (``fla``: flash-linear-attention's kernels; ``torch``: SDPA,
its backends pinned, FlexAttention), i.e. every registry peer of that ``Peer.library``, or a campaign file
(``.toml`` or ``.json``) naming a user's own kernels::

    title = "mylib"                  # the report's name
    distribution = "mylib"           # optional: the pip distribution whose version the report records
    [[kernel]]
    formulation = "gla"              # what it computes (FORMULATIONS.md name)
    function = "mylib.ops:gla"       # MODULE:FUNCTION, MODULE importable or a path to a .py file
    convention = "attnlab"           # attnlab (default), fla, peer or auto: as attnlab validate --convention

The plan. The controller resolves every kernel (imports it, chooses its convention; it calls none: the first
calls compile, and each worker makes its own), then lists the items: per (kernel, dtype) one error-vs-length
``curve`` item and one item per (strategy, property) of the passes asked for, exactly the property runs of
``attnlab validate``; a backward property (``backward_matches_oracle``...; "not applicable" where the kernel turns
out not to be differentiable) is one item that judges every gradient in turn (one verdict row per gradient,
``backward_matches_oracle[dq]``...), so that its gradients share each drawn case's backward pass
(attnlab.properties.checks' cache) in one process. It writes ``DIR/plan.json``. The items come in order
(:func:`plan_items`): first one item of every cell (kernel, dtype), so that every cell starts before any goes
further, then the rest of each cell in a row. pytest-xdist hands them out by cell
(attnlab.commands.campaign_schedule): a worker is sent the items of one cell at a time, a cell no worker has
started first, so that a library's kernels compile and autotune about once per cell, not once per worker.

The run. ``python -m pytest`` runs :mod:`attnlab.commands.campaign_items` under pytest-xdist: one worker per
GPU (``--workers-per-gpu`` more), each pinned to its GPU by ``CUDA_VISIBLE_DEVICES`` in its execnet spec, so
before anything in it starts CUDA; on the CPU ``--workers`` processes. Each worker gets its share of the host's cores
as its CPU threads (``OMP_NUM_THREADS``, unless set; :func:`worker_threads`): the oracles run on the CPU. Each item is one property search
(``attnlab validate``'s: derandomized, seeded by the item itself, so that a result does not depend on which
worker ran it, nor on the folder the kernel's file lies in: attnlab.properties.suite.portable_label) of at most
``--examples`` examples within ``--item-budget`` seconds (past it the search stops drawing; a failure is minimized
within what is left), and it appends its result to ``DIR/results/<worker>.jsonl`` as soon as it ends: a run cut
short keeps what it did. An item that starts after ``--budget`` seconds (counted from the first item) records "not
run" and why; the controller stops pytest one item budget and ``KILL_GRACE`` seconds after that. While it runs, a
progress bar counts items and every finding (failed, refused, error, imprecise) is printed as it lands.

Resuming. A re-run with the same ``--out`` skips every item with a result (held, imprecise, failed, refused)
and runs the rest (not run, killed, crashed, or new: another dtype, another pass); each search first replays
the counterexamples stored in the folder for that kernel and property (every dtype and strategy), then draws.
``--fresh`` discards the stored results. The results are merged by item key, so folders from several hosts
(each given a share of the kernels with ``--ops``) merge by copying their ``results/`` together and
re-rendering.

The report (attnlab.commands.campaign_report): ``DIR/campaign.json`` (the plan, the merged results, the wall
time) and ``DIR/campaign.md``: a summary table, one row per cell, then one section per kernel with its
error-vs-length table, every property's verdict, the imprecise ones, the failures with their minimal
counterexamples (classified) and a standalone reproducer for each bug.

Exit status: 0 when every cell ran completely and none failed (imprecise ones pass, unless ``--strict``);
1 when an item failed, was refused, erred or did not run; 2 on a usage error (unknown target, bad campaign
file, bad number, no GPU for ``--gpus``, pytest-xdist missing, no results to render).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from attnlab.commands import usage_error
from attnlab.commands.campaign_report import (CURVE, NOT_APPLICABLE, PLAN_NAME, REPORT_NAME, RESULTS_DIR, SUMMARY_NAME,
                                              junit_outcomes, node_id, read_results, render_and_say, render_command,
                                              summarize)
from attnlab.commands.validate import STRATEGIES, UsageError
from attnlab.conventions import CONVENTION_CHOICES, FLA_NUMERICS_ENV
from attnlab.registry import REGISTRY, names

PLAN_ENV = "ATTNLAB_CAMPAIGN_PLAN"
CRASHED = ("the process running this item died (the kernel crashed it: an illegal memory access, an abort, an "
           "exit)")  # the workers find the plan through it (xdist workers inherit the environment)
ITEMS_MODULE = Path(__file__).resolve().parent / "campaign_items.py"
# Seconds pytest may run past --budget and one --item-budget (an item started just before the budget ends, its
# last check and its minimization) before it is stopped.
KILL_GRACE = 30
MINIMIZE_CHECKS = 12
DEFAULT_DTYPES = {"cuda": ("bfloat16", "float16"), "cpu": ("float32", "float16")}
DEFAULT_LENGTHS = {"cuda": (64, 256, 1024, 4096), "cpu": (16, 64)}
CURVE_SHAPE = {"cuda": dict(B=1, H=2, K=64, V=64), "cpu": dict(B=1, H=1, K=16, V=16)}
# On the GPU the searches keep head dims at 64 (fla recompiles and autotunes per K and V) and T up to 1024.
GPU_SEARCH = dict(max_T=1024, max_dim=64, max_B=2, max_H=2)
GPU_DIMS = (64,)
# The statuses of an item that has its result (a re-run skips it): attnlab validate's, and "not applicable".
DONE = ("held", "imprecise", "failed", "refused", "error", NOT_APPLICABLE)


# ----------------------------------------------------------------------------- what is campaigned


@dataclass(frozen=True)
class CampaignKernel:
    """One kernel of a campaign: what it computes, where it is, how it is called."""

    formulation: str
    function: str  # MODULE:FUNCTION
    convention: str  # attnlab.conventions.CONVENTION_CHOICES
    label: str = ""

    @property
    def op(self) -> str:
        return self.function.rpartition(":")[2]

    @property
    def id(self) -> str:
        return f"{self.formulation}.{self.op}"


@dataclass(frozen=True)
class Library:
    """What a campaign judges: its kernels, and how its report reads (``calling``: how the kernels are called;
    ``env``: the environment variables that change its numerics, recorded)."""

    name: str
    title: str
    kernels: tuple[CampaignKernel, ...]
    distribution: str | None = None
    env: tuple[str, ...] = ()
    calling: str = ""


# The libraries whose conventions attnlab ships: the registry's peers of that Peer.library.
SHIPPED = {
    "fla": dict(title="flash-linear-attention", distribution="fla-core", env=FLA_NUMERICS_ENV, convention="peer",
                calling="Each kernel is called in its own convention (the registry's peers: fla's keywords, log gates, "
                        "`(o, final_state)` with `output_final_state`, fp32 states, RWKV-4's `log w` and `[B, 3, 1, C]` "
                        "state, linear attention's feature map applied outside) through the adapter, so that attnlab's "
                        "oracles and properties apply unchanged."),
    "torch": dict(title="torch", distribution="torch", env=(), convention="peer",
                  calling="Each kernel is called like `torch.nn.functional.scaled_dot_product_attention`: head-first "
                          "`[B, H, T, D]`, `is_causal`, returning o (the registry's torch peers: SDPA as torch picks its "
                          "backend, each backend pinned with `sdpa_kernel`, FlexAttention compiled with a causal block "
                          "mask; attnlab.third_party)."),
}


def shipped_targets() -> list[str]:
    """The libraries named by the registry's peers that attnlab ships a campaign for, in registry order."""
    return [lib for lib in dict.fromkeys(p.library for f in REGISTRY for p in f.peers) if lib in SHIPPED]


def shipped_library(name: str) -> Library:
    meta = SHIPPED[name]
    kernels = tuple(CampaignKernel(f.name, p.function, str(meta["convention"]), p.label)
                    for f in REGISTRY for p in f.peers if p.library == name)
    return Library(name, str(meta["title"]), kernels, str(meta["distribution"]), tuple(meta["env"]), str(meta["calling"]))


def load_campaign_file(path: Path) -> Library:
    """A user's campaign file (the module docstring's format); a UsageError says what is wrong with it."""
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(path.read_text())
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise UsageError(f"campaign file {path}: expected a .toml or .json file")
    except (OSError, ValueError) as error:
        raise UsageError(f"campaign file {path}: {error}") from error
    entries = data.get("kernel", [])
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"campaign file {path}: no [[kernel]] entries (each: formulation, function, convention)")
    kernels = []
    for n, entry in enumerate(entries, 1):
        missing = [k for k in ("formulation", "function") if k not in entry]
        if missing:
            raise UsageError(f"campaign file {path}: kernel {n} has no {' or '.join(missing)}")
        if entry["formulation"] not in names():
            raise UsageError(f"campaign file {path}: kernel {n}: unknown formulation {entry['formulation']!r}; "
                             f"expected one of {', '.join(names())}")
        convention = entry.get("convention", "attnlab")
        if convention not in CONVENTION_CHOICES:
            raise UsageError(f"campaign file {path}: kernel {n}: convention {convention!r}; expected one of "
                             f"{', '.join(CONVENTION_CHOICES)}")
        function = str(entry["function"])
        module = function.rpartition(":")[0]
        if module.endswith(".py") and not Path(module).is_absolute():  # a file path is relative to the campaign file
            function = f"{(path.parent / module).resolve()}:{function.rpartition(':')[2]}"
        kernels.append(CampaignKernel(entry["formulation"], function, convention, entry.get("label", "")))
    ids = [k.id for k in kernels]
    if len(set(ids)) != len(ids):
        raise UsageError(f"campaign file {path}: two kernels share a name ({', '.join(sorted({i for i in ids if ids.count(i) > 1}))})")
    title = str(data.get("title") or path.stem)
    return Library(title, title, tuple(kernels), data.get("distribution"), tuple(data.get("env", ())),
                   str(data.get("calling", "Each kernel is called in the convention its campaign file names.")))


def library_for(target: str) -> Library:
    """``fla``, ``torch`` or a campaign file's path; a UsageError names the choices."""
    if target in SHIPPED and target in shipped_targets():
        return shipped_library(target)
    path = Path(target)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise UsageError(f"campaign file {target}: no such file")
        return load_campaign_file(path)
    raise UsageError(f"unknown target {target!r}; known: {', '.join(shipped_targets())}, or a campaign file "
                     "(.toml or .json naming kernels and conventions)")


# ----------------------------------------------------------------------------- the plan


def resolve(kernel: dict[str, Any], dtype: str, device: str) -> tuple[Any, Any]:
    """(Target, Convention) of a plan's kernel, as attnlab validate resolves it; a UsageError or ValueError says why
    it cannot be called so."""
    from attnlab.commands.validate import load_kernel, make_target
    from attnlab.conventions import choose_convention, describe_detection
    from attnlab.evaluate import parse_dtype

    function = load_kernel(kernel["function"])
    convention, found = choose_convention(kernel["convention"], function, kernel["formulation"], kernel["function"],
                                          dtype=parse_dtype(dtype), device=device)
    if convention is None:
        raise UsageError(describe_detection(found, parse_dtype(dtype)) if found is not None else
                         f"no convention matched {kernel['function']}")
    return make_target(function, kernel["formulation"], kernel["function"], convention), convention


def plan_kernel(kernel: CampaignKernel, dtypes: list[str], device: str, passes: list[str],
                strategies: list[str]) -> dict[str, Any]:
    """A plan's kernel entry: resolved (imported, its convention chosen) without being called, and its properties
    per strategy; an entry with ``error`` when it cannot be resolved.

    Nothing is called here: the first call compiles (minutes for a library of Triton kernels, serially, before
    any item could start), so each worker finds out on its own items whether the kernel runs, and whether it is
    differentiable (a backward item of a kernel that is not records "not applicable").
    """
    from attnlab.commands.validate import convention_dict, properties_for

    entry: dict[str, Any] = {**asdict(kernel), "id": kernel.id, "op": kernel.op}
    try:
        target, convention = resolve(entry, dtypes[0], device)
    except Exception as error:  # noqa: BLE001 - a kernel that cannot be resolved is the cell's finding, not a crash
        entry["error"] = f"{type(error).__name__}: {error}".strip()
        return entry
    entry.update(resolved=convention_dict(convention), passes=passes,
                 properties={s: _grouped([p.name for p in properties_for(target, convention, s, None, passes,
                                                                         assume_differentiable=True)])
                             for s in strategies})
    return entry


def _grouped(properties: list[str]) -> dict[str, list[str]]:
    """Property names by item: a forward property alone, a backward check with its gradients' properties."""
    items: dict[str, list[str]] = {}
    for name in properties:
        items.setdefault(name.partition("[")[0], []).append(name)
    return items


def item_key(kernel_id: str, dtype: str, strategy: str, prop: str) -> str:
    return f"{kernel_id}/{dtype}/{strategy}/{prop}"


def plan_items(kernels: list[dict[str, Any]], dtypes: list[str], strategies: list[str], curve: bool) -> list[dict[str, Any]]:
    """Every item, in the order the campaign's scheduler reads them (attnlab.commands.campaign_schedule: a worker
    takes the first pending item of a cell nobody has started, or more of its own cell, in this order).

    First one item of every cell (kernel, dtype): the first property of its first strategy (``matches_oracle``
    under the default inputs, where the suite has it), so that every cell starts before any cell's second item.
    Then, cell after cell, the rest of each cell in a row, the curve first: a worker mostly runs one cell's items
    together, so that a library's Triton kernels compile and autotune about once per cell, not once per item (the
    first fla campaign, its items interleaved over 8 workers, paid a first call in 113 of its 115 items: 16 s each
    on average, against 0.1 s for the other two).
    """
    firsts, rests = [], []
    for k in kernels:
        if "error" in k:
            continue
        for dtype in dtypes:
            items = [{"kernel": k["id"], "dtype": dtype, "strategy": s, "property": p, "judges": judged}
                     for s in strategies for p, judged in k["properties"][s].items()]
            if curve:
                items.insert(1 if items else 0, {"kernel": k["id"], "dtype": dtype, "strategy": "default",
                                                 "property": CURVE})
            for item in items:
                item["key"] = item_key(item["kernel"], item["dtype"], item["strategy"], item["property"])
                item["pass"] = "backward" if item["property"].startswith("backward_") else "forward"
            firsts += items[:1]
            rests += items[1:]
    return firsts + rests


def stored_counterexamples(results: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """``kernel/property`` (a gradient's property for a backward check) -> the Cases (reprs) that failed or were
    imprecise there, in any dtype and strategy."""
    cases: dict[str, list[str]] = {}
    for r in results.values():
        for verdict in r.get("verdicts", []):
            if verdict["status"] in ("failed", "imprecise") and verdict.get("case"):
                listed = cases.setdefault(f"{r['kernel']}/{verdict['property']}", [])
                if verdict["case"] not in listed:
                    listed.append(verdict["case"])
    return cases


# ----------------------------------------------------------------------------- one item (in a worker)

# This process's resolved kernels, by (kernel id, dtype): a worker resolves each kernel once.
_RESOLVED: dict[tuple[str, str], tuple[Any, Any]] = {}


def load_plan(path: str | Path) -> dict[str, Any]:
    plan = json.loads(Path(path).read_text())
    plan["by_key"] = {item["key"]: item for item in plan["items"]}
    plan["kernels_by_id"] = {k["id"]: k for k in plan["kernels"]}
    plan["out"] = str(Path(path).parent)
    return plan


def _append(plan: dict[str, Any], record: dict[str, Any]) -> None:
    """One result line in this worker's file, flushed to disk before the item ends (a killed run keeps it)."""
    folder = Path(plan["out"]) / RESULTS_DIR
    folder.mkdir(exist_ok=True)
    with open(folder / f"{record['worker']}.jsonl", "a") as results:
        results.write(json.dumps(record, default=str) + "\n")
        results.flush()
        os.fsync(results.fileno())


def _curve(plan: dict[str, Any], kernel: dict[str, Any], target: Any, convention: Any, dtype: str) -> dict[str, Any]:
    from attnlab.commands import report
    from attnlab.commands.validate import error_curve
    from attnlab.conventions import fixed_scale
    from attnlab.metrics import worst_verdict
    from attnlab.registry import formulation

    shape = report.Sizes(**plan["curve_shape"])
    scale = fixed_scale(convention, shape.K) if "scale" in formulation(kernel["formulation"]).option_names else None
    rows = error_curve(kernel["formulation"], lambda **x: target(**x), kernel["function"], [dtype], plan["lengths"],
                       shape, plan["device"]["type"], compare=True, options={"scale": scale} if scale is not None else None)
    own = [r for r in rows if r["impl"] == kernel["function"]]
    excess = [r["excess"] for r in own if r.get("excess") is not None]
    return {"status": worst_verdict(report.row_verdict(r) for r in own), "rows": rows,
            "worst_excess": max(excess) if len(excess) == len(own) else None}


# An item's status: the worst of its verdict rows, in this order.
ITEM_ORDER = ("error", "refused", "failed", "imprecise", "held")


def _property(plan: dict[str, Any], kernel: dict[str, Any], target: Any, convention: Any, item: dict[str, Any]) -> dict[str, Any]:
    """The item's verdict rows: its property, or each gradient of its backward check in turn: the first within the
    item's budget, the others on the same draws (as many examples as the first had; checks' cache makes them cheap)."""
    from attnlab.commands.validate import Validation, repro_script, run_property
    from attnlab.evaluate import parse_dtype
    from attnlab.properties import suite
    from attnlab.properties.strategies import Case, Sizes

    device = plan["device"]["type"]
    if item["pass"] == "backward" and not target.differentiable:
        return {"status": NOT_APPLICABLE, "detail": "the kernel is not differentiable (called on inputs that require "
                                                    "grad, its output does not): it has no backward to judge"}
    by_name = {p.name: p for p in suite.applicable(target, tuple(kernel["passes"]))}
    deadline = time.monotonic() + plan["item_budget_s"]
    verdicts, repro = [], {}
    examples, until = plan["examples"], deadline
    for name in item["judges"]:
        replay = [eval(case, {"Case": Case}) for case in item.get("replay", {}).get(name, [])]  # noqa: S307 - reprs this campaign wrote
        verdict = run_property(by_name[name], target, parse_dtype(item["dtype"]), device, Sizes(**plan["sizes"]),
                               item["strategy"], examples, convention, plan["dims"], plan["minimize"],
                               replay=replay, deadline=until)
        # The other gradients replay the first one's draws (one digest per check): their backward runs are cached,
        # so they get as many examples as it had, past the item's budget.
        examples, until = max(1, verdict.examples), None
        verdicts.append({**asdict(verdict), "figure_text": verdict.figure_text(), "pass": verdict.pass_name,
                         "gradient": verdict.gradient})
        if verdict.status == "failed":
            validation = Validation(kernel["function"], kernel["formulation"], convention, device, [item["dtype"]],
                                    [item["strategy"]], plan["examples"], plan["sizes"])
            repro[name] = repro_script(validation, verdict, target.accepts_state)
    status = next(s for s in ITEM_ORDER if s == "held" or any(v["status"] == s for v in verdicts))
    return {"status": status, "verdicts": verdicts, "repro": repro}


def result_of(item: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """An item's stored result: the plan's item without what only the run reads (its replays, the gradients it
    judges), with ``fields``."""
    return {**{k: v for k, v in item.items() if k not in ("replay", "judges")}, **fields}


def run_item(plan: dict[str, Any], key: str) -> dict[str, Any]:
    """Run one item of the plan and append its result (attnlab.commands.campaign_items calls it); returns it."""
    import torch

    item = plan["by_key"][key]
    kernel = plan["kernels_by_id"][item["kernel"]]
    started = time.time()
    record: dict[str, Any] = result_of(item)
    record.update(worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
                  cpu_threads=torch.get_num_threads())
    if started > plan["deadline"]:
        record.update(status="not run", detail=f"not started: the campaign's budget of {plan['budget_s']:g} s was spent")
    else:
        try:
            cached = (kernel["id"], item["dtype"])
            if cached not in _RESOLVED:
                _RESOLVED[cached] = resolve(kernel, item["dtype"], plan["device"]["type"])
            target, convention = _RESOLVED[cached]
            if item["property"] == CURVE:
                record.update(_curve(plan, kernel, target, convention, item["dtype"]))
            else:
                record.update(_property(plan, kernel, target, convention, item))
        except Exception as error:  # noqa: BLE001 - the harness's error is this item's result, never a lost item
            record.update(status="error", detail=f"{type(error).__name__}: {error}")
    record.update(seconds=round(time.time() - started, 2), finished=_utc_now())
    _append(plan, record)
    return record


# ----------------------------------------------------------------------------- running


def _worker_specs(device: str, gpus: int, per_gpu: int, workers: int) -> list[str]:
    """pytest-xdist's options: on the GPU one execnet spec per worker, each pinning its GPU before the worker starts."""
    if device == "cuda":
        specs = [f"--tx=popen//env:CUDA_VISIBLE_DEVICES={g}" for g in range(gpus) for _ in range(per_gpu)]
        return ["--dist=load", *specs]
    return [f"--numprocesses={workers}", "--dist=load"]


def worker_threads(workers: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Each worker's share of the host's cores, as the CPU thread count torch reads at start-up (``OMP_NUM_THREADS``,
    unless the user set it). A worker's own work is mostly on the CPU (the float64 oracles, hypothesis, compiles), and
    torch's default of one thread per core in every worker oversubscribes the host as workers are added: measured on
    two H200s, 8 workers took 2.1x the item time of 4 and the campaign no less wall time."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // max(1, workers)))}


def pytest_command(out: Path, specs: list[str]) -> list[str]:
    """The pytest run of the campaign's items: an empty ini in ``out`` so the user's configuration stays out."""
    ini = out / "pytest.ini"
    ini.write_text("[pytest]\n")
    return [sys.executable, "-m", "pytest", str(ITEMS_MODULE), "-c", str(ini), "--rootdir", str(out),
            "--confcutdir", str(ITEMS_MODULE.parent), "-p", "xdist", "-p", "attnlab.commands.campaign_schedule",
            "-p", "no:cacheprovider", "-q",
            "--junitxml", str(out / "junit.xml"), *specs]


def record_crashes(out: Path, plan: dict[str, Any]) -> None:
    """A result for every item whose worker died under it (pytest-xdist's junit says so, and the item wrote none):
    failed, stored like any result, so that a re-run does not crash on it again."""
    stored = read_results(out)
    by_node = {node_id(i["key"]): i for i in plan["items"]}
    lines = []
    for key, why in junit_outcomes(out / "junit.xml").items():
        item = by_node.get(key)
        if item is not None and item["key"] not in stored and "crashed" in why:
            lines.append(json.dumps(result_of(item, status="failed", detail=f"{CRASHED}: {why}")) + "\n")
    if lines:
        with open(out / RESULTS_DIR / "crashed.jsonl", "a") as crashed:
            crashed.writelines(lines)


def findings(record: dict[str, Any]) -> list[str]:
    """The lines printed as an item lands: one per verdict row that did not hold, or the item's own status."""
    where = f"{record['kernel']} {record['dtype']} {record['strategy']}"
    lines = [f"{v['status'].upper()}: {where} {v['property']}: {v.get('figure_text') or (v.get('detail') or '')[:160]}"
             for v in record.get("verdicts", []) if v["status"] != "held"]
    if not record.get("verdicts") and record["status"] not in ("held", NOT_APPLICABLE):
        worst = record.get("worst_excess")
        lines.append(f"{record['status'].upper()}: {where} {record['property']}: "
                     + (f"worst excess {worst:.3g}" if worst else (record.get("detail") or "")[:160]))
    return [line.rstrip(": ") for line in lines]


def run_items(out: Path, plan: dict[str, Any], todo: list[dict[str, Any]], specs: list[str], progress: bool,
              since: str, threads: Mapping[str, str]) -> dict[str, Any]:
    """Run pytest-xdist on the plan (the items in ``todo``), its workers given ``threads`` (:func:`worker_threads`),
    following ``out/results`` as it runs: the results that finished ``since`` the run started (a todo item may hold an
    earlier run's record, not this run's). Returns the run's record (wall time, pytest's exit status, whether it was
    stopped at the budget)."""
    from tqdm import tqdm

    started = time.time()
    keys = {item["key"] for item in todo}
    seen: set[str] = set()
    bar = tqdm(total=len(todo), desc="attnlab campaign", unit="item", disable=not progress, file=sys.stderr)
    env = {**os.environ, **threads, PLAN_ENV: str(out / PLAN_NAME)}
    with open(out / "pytest.log", "w") as log:
        proc = subprocess.Popen(pytest_command(out, specs), stdout=log, stderr=subprocess.STDOUT, env=env)
        killed = False
        while proc.poll() is None:
            time.sleep(1.0)
            seen |= _follow(out, keys, seen, bar, since)
            if time.time() > plan["deadline"] + plan["item_budget_s"] + KILL_GRACE and not killed:
                proc.terminate()
                killed = True
        seen |= _follow(out, keys, seen, bar, since)
    bar.close()
    return {"seconds": round(time.time() - started, 1), "pytest_exit": proc.returncode, "stopped": killed}


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime())


def record_stopped(out: Path, plan: dict[str, Any], todo: list[dict[str, Any]], since: str) -> None:
    """A "not run" result, saying so, for every item of a run the controller stopped that has no result of that run
    (finished ``since`` its start): running then, or never started (an earlier run's record of the item would
    otherwise give a stale reason)."""
    stored = read_results(out)
    items = [item for item in todo if stored.get(item["key"], {}).get("finished", "") < since]
    stop = plan["budget_s"] + plan["item_budget_s"] + KILL_GRACE
    detail = (f"stopped: no result when the campaign was stopped {stop:g} s after its first item (its budget, one "
              "item budget and a grace); it was still running or had not started")
    with open(out / RESULTS_DIR / "stopped.jsonl", "a") as stopped:
        stopped.writelines(json.dumps(result_of(item, status="not run", detail=detail, finished=_utc_now())) + "\n"
                           for item in items)


def _follow(out: Path, keys: set[str], seen: set[str], bar: Any, since: str) -> set[str]:
    """Report this run's results that landed since the last look; returns their keys."""
    new = {k: r for k, r in read_results(out).items()
           if k in keys and k not in seen and r.get("finished", "") >= since}
    for record in new.values():
        for line in findings(record):
            bar.write(line)
        bar.update()
    return set(new)


def _versions(library: Library) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from attnlab.commands import report

    found = report.versions()
    if library.distribution:
        try:
            found[library.distribution] = version(library.distribution)
        except PackageNotFoundError:
            pass
    try:
        found["pytest-xdist"] = version("pytest-xdist")
    except PackageNotFoundError:
        pass
    return found


def make_plan(library: Library, *, device: str, dtypes: list[str], strategies: list[str],
              passes: list[str], examples: int, item_budget: float, budget: float, lengths: list[int],
              strict: bool, command: str, workers: str) -> dict[str, Any]:
    from attnlab.commands import report
    from attnlab.properties.suite import sizes_for

    sizes = sizes_for(device, "ci")
    dims = list(GPU_DIMS) if device == "cuda" else None
    if device == "cuda":
        sizes = replace(sizes, **GPU_SEARCH)
    kernels = [plan_kernel(k, dtypes, device, passes, strategies) for k in library.kernels]
    return {"target": library.name, "title": library.title, "distribution": library.distribution,
            "calling": library.calling, "env": {k: os.environ.get(k) for k in library.env},
            "versions": _versions(library), "device": {"type": device, "name": report.device_description(device)},
            "dtypes": dtypes, "strategies": strategies, "passes": passes, "examples": examples,
            "item_budget_s": item_budget, "budget_s": budget,
            "sizes": asdict(sizes), "dims": dims, "minimize": MINIMIZE_CHECKS, "lengths": lengths,
            "curve_shape": CURVE_SHAPE[device], "strict": strict, "command": command, "workers": workers,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kernels": kernels,
            "items": plan_items(kernels, dtypes, strategies, bool(lengths))}


# ----------------------------------------------------------------------------- command line


HELP = """\
Run attnlab validate's property searches on every kernel of TARGET, forward and backward, as pytest items
spread by pytest-xdist over the GPUs (one worker per GPU, pinned by CUDA_VISIBLE_DEVICES) or CPU workers,
then render DIR/campaign.md.

TARGET: fla or torch (the registry's peers of that library, each in its declared convention), or a
campaign file naming your own kernels:

    title = "mylib"
    [[kernel]]
    formulation = "gla"                  # what it computes
    function = "mylib/ops.py:chunk_gla"  # MODULE:FUNCTION, or a .py path relative to the file
    convention = "attnlab"               # attnlab, fla, peer or auto (as attnlab validate --convention)

Each item (kernel, dtype, strategy, property) searches at most --examples inputs within --item-budget
seconds and appends its result to DIR/results/ as it ends; findings print as they land. Every cell
(kernel, dtype) gets its first item before any gets a second. Run again with the same --out to resume:
done items are skipped and stored counterexamples replayed first (--fresh starts over). A worker that
dies is its item's failed result. --render DIR re-renders results anywhere."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``attnlab campaign`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "campaign", help="the property suite on every kernel of a library (fla, torch, or a campaign file), "
                         "spread over GPUs (or CPU workers) by pytest-xdist, rendered as one report",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 every cell ran completely and none failed (imprecise ones pass unless --strict); "
               "1 an item failed, was refused, erred or did not run, or was imprecise under --strict; 2 usage error.")
    parser.add_argument("target", nargs="?", default=None, metavar="TARGET",
                        help=f"{', '.join(shipped_targets())}, or a campaign file (.toml/.json) naming kernels")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the kernels run (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--gpus", default="all", metavar="N|all", help="GPUs to spread the items over (default all)")
    parser.add_argument("--workers-per-gpu", type=int, default=1, metavar="N",
                        help="pytest-xdist workers per GPU (default 1; more overlap Triton's compiles)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="pytest-xdist workers on the CPU (default: the CPU count, at most 8)")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds for the items, from the first (default 1800): an item due "
                             "to start later records not run; the run is stopped an item budget and 30 s after it")
    parser.add_argument("--item-budget", type=float, default=60.0,
                        help="seconds per item: its search stops drawing past it (default 60)")
    parser.add_argument("--examples", type=int, default=6, help="examples per item (default 6)")
    parser.add_argument("--dtypes", default=None, help="comma-separated (default bfloat16,float16 on cuda, "
                                                       "float32,float16 on cpu)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="default, adversarial or both (default both)")
    parser.add_argument("--passes", default="forward,backward",
                        help="forward, backward or both (default both; backward only for differentiable kernels)")
    parser.add_argument("--ops", default=None, help="comma-separated function names (default every kernel of the target)")
    parser.add_argument("--lengths", default=None, metavar="LIST|none",
                        help="the curve's lengths (default 64,256,1024,4096 on cuda, 16,64 on cpu; none: no curve)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default out/campaign-TARGET)")
    parser.add_argument("--fresh", action="store_true", help="discard the results already in --out (default: resume)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (findings are still printed)")
    parser.add_argument("--render", type=Path, default=None, metavar="DIR",
                        help="only render the results in DIR (a run's --out), on any machine")
    parser.add_argument("--preface", type=Path, default=None, metavar="FILE",
                        help="with --render: Markdown placed after the report's header (what you found, in your words)")
    parser.add_argument("--report", type=Path, default=None, metavar="PATH",
                        help=f"where the Markdown goes (default DIR/{REPORT_NAME})")
    parser.add_argument("--strict", action="store_true",
                        help="an imprecise item (above the accuracy bound, within the correctness bound) fails the "
                             "campaign (exit 1)")
    parser.set_defaults(func=command)
    return parser


def _usage(message: str) -> int:
    return usage_error("campaign", message)


def _list(text: str | None, allowed: tuple[str, ...] | list[str], flag: str) -> list[str]:
    chosen = [t.strip() for t in (text or "").split(",") if t.strip()]
    bad = [t for t in chosen if t not in allowed]
    if bad or not chosen:
        raise UsageError(f"{flag} {text!r}: expected some of {', '.join(allowed)}")
    return list(dict.fromkeys(chosen))


def _lengths(text: str | None, device: str) -> list[int]:
    if text is None:
        return list(DEFAULT_LENGTHS[device])
    if text == "none":
        return []
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise UsageError(f"--lengths {text!r}: expected positive integers (64,256) or none")
    return lengths


def _gpus(text: str) -> int:
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise UsageError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    if text == "all":
        return visible
    if not text.isdigit() or not 1 <= int(text) <= visible:
        raise UsageError(f"--gpus {text!r}: expected all or 1..{visible} (GPUs visible here)")
    return int(text)


def command(args: argparse.Namespace) -> int:
    if args.render is not None:
        return render_command(args.render, args.report, args.strict, args.preface)
    try:
        if args.target is None:
            raise UsageError(f"name a target: {', '.join(shipped_targets())}, or a campaign file (.toml or .json)")
        library = library_for(args.target)
        if args.budget <= 0 or args.item_budget <= 0 or args.examples < 1 or args.workers_per_gpu < 1 or (
                args.workers is not None and args.workers < 1):
            raise UsageError("--budget and --item-budget must be positive, --examples, --workers and "
                             "--workers-per-gpu at least 1")
        if importlib.util.find_spec("xdist") is None:
            raise UsageError("a campaign runs on pytest-xdist, which is not installed here (pip install pytest-xdist)")
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        gpus = _gpus(args.gpus) if device == "cuda" else 0
        dtypes = _list(args.dtypes or ",".join(DEFAULT_DTYPES[device]), ("bfloat16", "float16", "float32"), "--dtypes")
        if device == "cpu" and "bfloat16" in dtypes:
            raise UsageError("--dtypes bfloat16 needs a GPU (the Triton interpreter computes bf16 on raw bit patterns)")
        strategies = _list(args.strategies, STRATEGIES, "--strategies")
        passes = _list(args.passes, ("forward", "backward"), "--passes")
        lengths = _lengths(args.lengths, device)
        if args.ops is not None:
            wanted = _list(args.ops, [k.op for k in library.kernels], "--ops")
            library = replace(library, kernels=tuple(k for k in library.kernels if k.op in wanted))
    except UsageError as error:
        return _usage(str(error))
    workers = args.workers or min(8, os.cpu_count() or 1)
    specs = _worker_specs(device, gpus, args.workers_per_gpu, workers)
    threads = worker_threads(gpus * args.workers_per_gpu if device == "cuda" else workers)
    where = f"{gpus} GPU(s) x {args.workers_per_gpu} worker(s)" if device == "cuda" else f"{workers} CPU worker(s)"
    where += f", {threads['OMP_NUM_THREADS']} CPU thread(s) each" if threads else ""
    out: Path = args.out or Path("out") / f"campaign-{library.name}"
    out.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        for path in (out / RESULTS_DIR).glob("*.jsonl"):
            path.unlink()
    invocation = "attnlab campaign " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["campaign"] else ""
    plan = make_plan(library, device=device, dtypes=dtypes, strategies=strategies, passes=passes,
                     examples=args.examples, item_budget=args.item_budget, budget=args.budget, lengths=lengths,
                     strict=args.strict, command=invocation or f"attnlab campaign {args.target}", workers=where)
    stored = read_results(out)
    replay = stored_counterexamples(stored)
    for item in plan["items"]:
        cases = {name: replay[f"{item['kernel']}/{name}"] for name in item.get("judges", ())
                 if f"{item['kernel']}/{name}" in replay}
        if cases:
            item["replay"] = cases
    todo = [item for item in plan["items"] if stored.get(item["key"], {}).get("status") not in DONE]
    plan["deadline"] = time.time() + args.budget  # the budget counts from the first item, after the probes
    (out / PLAN_NAME).write_text(json.dumps({**plan, "todo": [i["key"] for i in todo]}, indent=1, default=str) + "\n")
    broken = [k for k in plan["kernels"] if "error" in k]
    print(f"campaign {library.name}: {len(plan['kernels'])} kernels, {len(plan['items'])} items "
          f"({len(plan['items']) - len(todo)} done in {out}, {len(todo)} to run) on {where}; "
          f"{args.item_budget:g} s per item, budget {args.budget:g} s", flush=True)
    for k in broken:
        print(f"ERROR: {k['id']} cannot be called: {k['error'][:300]}", flush=True)
    previous = json.loads((out / SUMMARY_NAME).read_text()).get("runs", []) if (out / SUMMARY_NAME).exists() and not args.fresh else []
    run = {"items": len(todo), "workers": where, "started": _utc_now()}
    if todo:
        run.update(run_items(out, plan, todo, specs, progress=not args.no_progress, since=run["started"], threads=threads))
        record_crashes(out, plan)
        if run["stopped"]:
            record_stopped(out, plan, todo, run["started"])
    summarize(out, plan, [*previous, run])
    return render_and_say(out, args.report or out / REPORT_NAME, args.strict)
