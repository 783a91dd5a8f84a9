"""``attnlab campaign``: usage errors, the job list drawn from the registry, and rendering a results folder.

No campaign runs here (fla is not installed and there is no GPU): the results are hand-made, shaped as
``attnlab campaign`` and ``attnlab validate --out`` write them.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.commands import campaign
from attnlab.commands.campaign import (TARGETS, job_command, job_order, kernels, known_targets, run_campaign,
                                       slot_seconds)
from attnlab.registry import REGISTRY, names

ROOT = Path(__file__).resolve().parent.parent
FLA = TARGETS["fla"]


def run(*argv: str) -> tuple[int, str, str]:
    """``attnlab campaign ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["campaign", *argv])
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------- usage


def test_an_unknown_target_is_a_usage_error_naming_the_known_ones() -> None:
    result = subprocess.run([sys.executable, "-m", "attnlab.cli", "campaign", "nosuch"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unknown target 'nosuch'; known: fla" in result.stderr


@pytest.mark.parametrize("argv, message", [
    ((), "name a target: one of fla"),
    (("fla", "--ops", "chunk_gla,nosuch"), "--ops: unknown nosuch; fla's kernels: parallel_attn, chunk_linear_attn"),
    (("fla", "--jobs", "0"), "--jobs and --examples at least 1"),
    (("fla", "--dtypes", "float8"), "--dtypes must be some of"),
    (("--render", "no/such/folder"), "no campaign.json and no */report.json there"),
])
def test_usage_errors_exit_2(argv: tuple[str, ...], message: str) -> None:
    code, _, stderr = run(*argv)
    assert code == 2 and message in stderr, stderr


# ----------------------------------------------------------------------------- the job list


def fla_peers() -> list[tuple[str, str]]:
    return [(f.name, p.function) for f in REGISTRY for p in f.peers if p.library == "fla"]


def test_the_targets_are_the_peers_libraries_with_a_campaign() -> None:
    assert known_targets() == ["fla"]
    assert {p.library for f in REGISTRY for p in f.peers} >= {"fla"}


def test_the_jobs_are_every_fla_peer_once_per_dtype_slow_ones_first() -> None:
    dtypes = ["bfloat16", "float16"]
    jobs = job_order(FLA, kernels(FLA), dtypes)
    expected = fla_peers()
    assert len(expected) >= 14
    assert sorted((j.formulation, j.peer.function, j.dtype) for j in jobs) == sorted(
        (name, function, dtype) for name, function in expected for dtype in dtypes)
    # One kernel's dtypes adjacent; chunk_* first; registry order within each group.
    pairs = [(j.formulation, j.peer.function) for j in jobs]
    assert pairs[::2] == pairs[1::2] and [j.dtype for j in jobs] == dtypes * len(expected)
    order = pairs[::2]
    chunked = [k for k in expected if k[1].rpartition(":")[2].startswith("chunk_")]
    assert chunked and order == chunked + [k for k in expected if k not in chunked]
    # The same function under two formulations (fla's fused_recurrent_gla: gla and general) gets two folders.
    assert len({j.folder for j in jobs}) == len(jobs)
    assert [n for n, p in kernels(FLA, ["fused_recurrent_gla"])] == [
        f.name for f in REGISTRY for p in f.peers if p.library == "fla" and p.attribute == "fused_recurrent_gla"]


def test_a_job_validates_the_registry_function_in_the_targets_convention(tmp_path: Path) -> None:
    job = job_order(FLA, kernels(FLA, ["fused_recurrent_rwkv4"]), ["bfloat16"])[0]
    argv = job_command(FLA, job, tmp_path, examples=6, time_budget=100)
    assert argv[1:4] == ["-m", "attnlab.cli", "validate"]
    text = " ".join(argv)
    assert f"--kernel {job.peer.function} --convention fla --formulation {job.formulation}" in text
    assert "--dtype bfloat16" in text and "--time-budget 100" in text and "--curve-first" in text
    assert "--strict" not in argv and job_command(FLA, job, tmp_path, 6, 100, strict=True) == [*argv, "--strict"]


def test_fair_slots() -> None:
    assert slot_seconds(400, 10, 30) == pytest.approx((400 - campaign.KILL_GRACE) / 3)
    assert slot_seconds(400, 10, 5) == pytest.approx(400 - campaign.KILL_GRACE)


def test_the_module_never_names_a_formulation() -> None:
    tree = ast.parse((ROOT / "attnlab" / "commands" / "campaign.py").read_text())
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not strings & set(names())


# ----------------------------------------------------------------------------- rendering

CASE = "Case(name='deltanet', seed=3, B=1, T=2, H=1, K=1, V=1)"


def verdict(strategy: str, prop: str, status: str, figure: float | None, bound: float, case: str = "",
            measure: str = "excess = rel_err / floor", detail: str = "", correctness: float | None = None) -> dict:
    text = "" if figure is None else f"{figure:.3g} / {bound:.3g} (excess" + (
        f"; failed above {correctness:.3g})" if correctness else ")")
    return {"strategy": strategy, "dtype": "bfloat16", "property": prop, "status": status, "examples": 6,
            "figure": figure, "bound": bound, "correctness": correctness, "measure": measure, "case": case,
            "found": case, "detail": detail, "held": status == "held", "figure_text": text}


def curve(name: str, impl: str, excess: float) -> list[dict]:
    return [{"formulation": name, "impl": i, "dtype": "bfloat16", "T": T, "rel_err": 1e-3 * e, "floor": 1e-3,
             "nonfinite": 0, "excess": e, "error": None} for T in (64, 256) for i, e in ((impl, excess), ("attnlab:chunkwise", 1.0))]


def report(name: str, function: str, verdicts: list[dict], excess: float, repro: dict | None = None,
           graded: str | None = None) -> dict:
    """A validate report.json; ``graded``: its overall verdict (None: a report from before the three verdicts)."""
    return {"kernel": function, "formulation": name, "held": all(v["held"] for v in verdicts),
            "exit_code": 0 if all(v["held"] for v in verdicts) else 1,
            **({"verdict": graded, "bounds": {"bfloat16": {"accuracy": 1.5, "correctness": 8.0}}} if graded else {}),
            "convention": {"describe": f"fla:{function.rpartition(':')[2]}: returns='o_state'", "derived": []},
            "device": {"type": "cuda", "name": "NVIDIA H100"}, "dtypes": ["bfloat16"], "examples": 6,
            "sizes": {"max_T": 1024}, "env": {"FLA_USE_FAST_OPS": None},
            "versions": {"torch": "2.11.0", "fla-core": "0.6.0"}, "verdicts": verdicts, "repro": repro or {},
            "curve": {"rows": curve(name, function, excess)}}


def results(tmp_path: Path, with_failure: bool = True) -> Path:
    """A campaign folder: gla's chunk_gla held, deltanet's chunk_delta_rule failed, one kernel killed."""
    folder = tmp_path / "campaign-fla"
    records, reports = [], {}
    reports["gla.chunk_gla-bfloat16"] = report("gla", "fla.ops:chunk_gla", [
        verdict("default", "matches_oracle", "held", 1.2, 1.5, "Case(name='gla', seed=0, B=1, T=1, H=1, K=1, V=1)"),
        verdict("adversarial", "causality", "held", 0.0, 0.0, "Case(name='gla', seed=0, B=1, T=2, H=1, K=1, V=1)",
                measure="output entries before the cut that changed")], excess=1.4)
    records.append({"formulation": "gla", "op": "chunk_gla", "dtype": "bfloat16", "folder": "gla.chunk_gla-bfloat16",
                    "status": "held", "rc": 0})
    if with_failure:
        reports["deltanet.chunk_delta_rule-bfloat16"] = report("deltanet", "fla.ops:chunk_delta_rule", [
            verdict("default", "matches_oracle", "failed", 45.0, 1.5, CASE,
                    detail="rel_err 7.7e-02, max_err 1.0e-01, floor_round 1.7e-03"),
            verdict("adversarial", "matches_oracle", "skipped", None, 1.5)], excess=2.81,
            repro={"default/bfloat16/matches_oracle": "print('reproduced')\n"})
        records.append({"formulation": "deltanet", "op": "chunk_delta_rule", "dtype": "bfloat16",
                        "folder": "deltanet.chunk_delta_rule-bfloat16", "status": "failed", "rc": 1})
        records.append({"formulation": "kda", "op": "chunk_kda", "dtype": "float16", "folder": "kda.chunk_kda-float16",
                        "status": "timed out", "rc": None, "detail": "killed after 140 s (its slot)"})
    for key, data in reports.items():
        (folder / key).mkdir(parents=True)
        (folder / key / "report.json").write_text(json.dumps(data))
    (folder / "kda.chunk_kda-float16").mkdir(parents=True, exist_ok=True)
    (folder / "campaign.json").write_text(json.dumps({
        "target": "fla", "version": "0.6.0", "command": "attnlab campaign fla --budget 400.0 --jobs 10 --examples 6",
        "budget_s": 400.0, "jobs": 10, "examples": 6, "lengths": "64,256", "curve_shape": "1,2,64,64",
        "started": "2026-11-25T10:00:00+0000", "records": records}))
    return folder


def test_rendering_a_results_folder(tmp_path: Path) -> None:
    folder = results(tmp_path)
    code, stdout, stderr = run("--render", str(folder))
    assert code == 1, stdout + stderr  # a property failed and a job was killed
    text = (folder / "campaign.md").read_text()
    assert text.startswith("# flash-linear-attention 0.6.0 under `attnlab validate`\n")
    assert "- Device: NVIDIA H100" in text
    assert "- Campaign: `attnlab campaign fla --budget 400.0 --jobs 10 --examples 6` (budget 400.0 s, 10 parallel jobs)" in text
    # The summary table: one row per job, in the campaign's order.
    counts, summary = text.split("## Summary\n\n")[1].split("\n\n")[:2]
    assert counts == "3 jobs: 1 held, 1 failed, 1 timed out."
    summary = summary.splitlines()
    assert summary == [
        "| formulation | fla kernel | dtype | verdict | default | adversarial | worst curve excess (fla) | worst curve excess (attnlab) | failed / imprecise properties |",
        "|---|---|---|---|---|---|---|---|---|",
        "| gla | `chunk_gla` | bfloat16 | held | held | held | 1.4 | chunkwise 1 |  |",
        "| deltanet | `chunk_delta_rule` | bfloat16 | failed | 1 failed | 1 not run | 2.81 | chunkwise 1 | matches_oracle |",
        "| kda | `chunk_kda` | float16 | timed out |  |  |  |  | killed after 140 s (its slot) |",
    ]
    # Sections in the registry's order, the failed property with its Case and its classification.
    assert text.index("## gla: `chunk_gla`") < text.index("## deltanet: `chunk_delta_rule`") < text.index("## kda: `chunk_kda`")
    assert "- float16: timed out killed after 140 s (its slot)" in text
    assert f"| default | bfloat16 | matches_oracle | **FAILED** | 6 | 45 / 1.5 (excess) | `{CASE}` |" in text
    assert (f"- **matches_oracle** (default, bfloat16): 45 / 1.5 (excess); minimal counterexample `{CASE}`. "
            "Bug: 30x the bound (45 > 1.5).") in text
    assert "## Reproducing the bugs" in text and "### chunk_delta_rule: matches_oracle (default, bfloat16)" in text
    assert "```python\nprint('reproduced')\n```" in text
    assert "| gla | `fla.ops:chunk_gla` | bfloat16 | 1.40 | 1.40 |" in text  # the excess-by-length table


def test_rendering_where_every_job_held_exits_0_and_report_goes_where_asked(tmp_path: Path) -> None:
    folder = results(tmp_path, with_failure=False)
    code, stdout, stderr = run("fla", "--render", str(folder), "--report", str(tmp_path / "fla-0.6.0.md"))
    assert code == 0, stdout + stderr
    text = (tmp_path / "fla-0.6.0.md").read_text()
    assert "| gla | `chunk_gla` | bfloat16 | held | held | held | 1.4 | chunkwise 1 |  |" in text
    assert "### Failures" not in text and "Reproducing" not in text
    assert not (folder / "campaign.md").exists()


def test_rendering_without_campaign_json_reads_the_reports(tmp_path: Path) -> None:
    folder = results(tmp_path)
    (folder / "campaign.json").unlink()
    code, stdout, stderr = run("--render", str(folder))
    assert code == 1, stdout + stderr
    text = (folder / "campaign.md").read_text()
    assert "| deltanet | `chunk_delta_rule` | bfloat16 | failed | 1 failed | 1 not run | 2.81 |" in text
    assert "| gla | `chunk_gla` | bfloat16 | held | held | held |" in text


IMPRECISE_CASE = "Case(name='gla', seed=4, B=1, T=64, H=1, K=64, V=64)"


def graded_results(tmp_path: Path, with_failure: bool = False, strict_run: bool = False) -> Path:
    """A campaign whose gla job is imprecise (recorded "held" from its exit code 0, as a campaign before the three
    verdicts wrote it: the report's verdict decides), and with ``with_failure`` a deltanet job that failed."""
    folder = results(tmp_path, with_failure=False)
    gla = folder / "gla.chunk_gla-bfloat16" / "report.json"
    gla.write_text(json.dumps(report("gla", "fla.ops:chunk_gla", [
        verdict("default", "matches_oracle", "imprecise", 3.2, 1.5, IMPRECISE_CASE, correctness=8.0),
        verdict("adversarial", "matches_oracle", "imprecise", 2.1, 1.5, IMPRECISE_CASE, correctness=8.0),
        verdict("adversarial", "causality", "held", 0.0, 0.0, measure="output entries before the cut that changed")],
        excess=1.4, graded="imprecise")))
    data = json.loads((folder / "campaign.json").read_text())
    data["strict"] = strict_run
    if with_failure:
        (folder / "deltanet.chunk_delta_rule-bfloat16").mkdir()
        (folder / "deltanet.chunk_delta_rule-bfloat16" / "report.json").write_text(json.dumps(report(
            "deltanet", "fla.ops:chunk_delta_rule", [verdict("default", "matches_oracle", "failed", 45.0, 1.5, CASE,
                                                             correctness=8.0)], excess=2.81, graded="failed")))
        data["records"].append({"formulation": "deltanet", "op": "chunk_delta_rule", "dtype": "bfloat16",
                                "folder": "deltanet.chunk_delta_rule-bfloat16", "status": "failed", "rc": 1})
    (folder / "campaign.json").write_text(json.dumps(data))
    return folder


def test_an_imprecise_campaign_renders_imprecise_and_exits_0(tmp_path: Path) -> None:
    folder = graded_results(tmp_path)
    code, stdout, stderr = run("--render", str(folder))
    assert code == 0, stdout + stderr
    assert "every job ran and none failed" in stdout
    text = (folder / "campaign.md").read_text()
    assert "1 jobs: 1 imprecise." in text
    assert ("| gla | `chunk_gla` | bfloat16 | imprecise | 1 imprecise (worst 3.2; held <= 1.5, failed > 8) "
            "| 1 held, 1 imprecise (worst 2.1; held <= 1.5, failed > 8) | 1.4 | chunkwise 1 | imprecise: matches_oracle |") in text
    assert ("| default | bfloat16 | matches_oracle | imprecise | 6 | 3.2 / 1.5 (excess; failed above 8) "
            f"| `{IMPRECISE_CASE}` |") in text
    assert "### Imprecise" in text and "### Failures" not in text and "Reproducing" not in text
    assert (f"- **matches_oracle** (default, bfloat16): 3.2 / 1.5 (excess; failed above 8); worst input "
            f"`{IMPRECISE_CASE}`.") in text
    assert "bfloat16 held <= 1.5, failed > 8" in text


@pytest.mark.parametrize("strict_run", [False, True])
def test_under_strict_an_imprecise_campaign_exits_1(tmp_path: Path, strict_run: bool) -> None:
    """--strict given to the render, or recorded in campaign.json by a run with it."""
    folder = graded_results(tmp_path, strict_run=strict_run)
    code, stdout, stderr = run("--render", str(folder), *([] if strict_run else ["--strict"]))
    assert code == 1, stdout + stderr
    assert "or was imprecise under --strict" in stdout
    text = (folder / "campaign.md").read_text()
    assert "| gla | `chunk_gla` | bfloat16 | imprecise |" in text and "(fails the campaign under --strict)" in text


def test_a_failed_job_beside_an_imprecise_one_exits_1(tmp_path: Path) -> None:
    folder = graded_results(tmp_path, with_failure=True)
    code, stdout, stderr = run("--render", str(folder))
    assert code == 1, stdout + stderr
    text = (folder / "campaign.md").read_text()
    assert "2 jobs: 1 imprecise, 1 failed." in text
    assert "| deltanet | `chunk_delta_rule` | bfloat16 | failed | 1 failed | - | 2.81 |" in text


def test_a_run_records_each_jobs_status_from_its_report_else_its_exit_code(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    """The job's validate is a stand-in script: it writes a report.json with the verdict its folder names, or none."""
    exits = {"chunk_gla": ("imprecise", 0), "chunk_delta_rule": ("failed", 1), "chunk_linear_attn": (None, 0),
             "chunk_kda": (None, 1), "fused_recurrent_rwkv4": (None, 3)}
    work = job_order(FLA, kernels(FLA, list(exits)), ["bfloat16"])
    stale = tmp_path / work[-1].folder
    stale.mkdir(parents=True)
    (stale / "report.json").write_text(json.dumps({"verdict": "held"}))  # an earlier run's: not this job's

    def stand_in(target, job, out, examples, time_budget, strict=False):
        graded, rc = exits[job.op]
        write = f"open({str(out / 'report.json')!r}, 'w').write({json.dumps(json.dumps({'verdict': graded}))});" if graded else ""
        return [sys.executable, "-c", f"{write}raise SystemExit({rc})"]

    monkeypatch.setattr(campaign, "job_command", stand_in)
    summary = run_campaign(FLA, tmp_path, budget=200, jobs=len(work), examples=1, work=work, strict=True)
    statuses = {r["op"]: r["status"] for r in summary["records"]}
    assert statuses == {"chunk_gla": "imprecise", "chunk_delta_rule": "failed", "chunk_linear_attn": "held",
                        "chunk_kda": "failed", "fused_recurrent_rwkv4": "error"}
    assert summary["strict"] is True and json.loads((tmp_path / "campaign.json").read_text())["strict"] is True
    assert "5 jobs: 1 held, 1 imprecise, 2 failed, 1 error" in capsys.readouterr().out


def test_a_refused_backward_renders_refused_with_the_kernels_message_and_exits_1(tmp_path: Path) -> None:
    """fla's gated ops refuse their backward on Hopper with older Triton: a finding, rendered, never a crash."""
    folder = tmp_path / "campaign-fla"
    message = "chunk_gla's backward is disabled on this GPU"
    data = report("gla", "fla.ops:chunk_gla", [
        verdict("default", "matches_oracle", "held", 1.2, 1.5, "Case(name='gla', seed=0, B=1, T=1, H=1, K=1, V=1)"),
        verdict("default", "backward_matches_oracle[dq]", "refused", None, 1.5, detail=message,
                measure="the kernel's backward raised")], excess=1.4, graded="failed")
    (folder / "gla.chunk_gla-bfloat16").mkdir(parents=True)
    (folder / "gla.chunk_gla-bfloat16" / "report.json").write_text(json.dumps(data))
    (folder / "campaign.json").write_text(json.dumps({
        "target": "fla", "version": "0.6.0", "command": "attnlab campaign fla", "budget_s": 400.0, "jobs": 1,
        "examples": 6, "lengths": "64", "curve_shape": "1,2,64,64", "started": "2026-11-25T10:00:00+0000",
        "records": [{"formulation": "gla", "op": "chunk_gla", "dtype": "bfloat16", "folder": "gla.chunk_gla-bfloat16",
                     "status": "failed", "rc": 1}]}))
    code, stdout, stderr = run("--render", str(folder))
    assert code == 1, stdout + stderr
    text = (folder / "campaign.md").read_text()
    assert "1 held, 1 refused (backward)" in text and "**REFUSED**" in text and message in text
