"""``attnlab report`` and ``attnlab map``, run the way a user runs them, on tiny configurations (CPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.kernel import backward_forms
from attnlab.commands.report import (BACKWARD_KEYS, METRIC_KEYS, VERDICT_KEYS, Implementation, growth_exponent,
                                     measure_backward_point, textbook_guides)
from attnlab.registry import BOUNDS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROW_KEYS = {"formulation", "impl", "dtype", "T", *METRIC_KEYS, *VERDICT_KEYS, "ref_nonfinite", "oracle", "oracle_check",
            "error"}
TINY = ("--shape", "1,1,16,16", "--seed", "3")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlab.cli", *args], capture_output=True, text=True, timeout=600)


def assert_png(path: Path) -> None:
    """A readable PNG with a plausible size (matplotlib can load it back)."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= 400 and height >= 300, (path, width, height)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """gla (kernels present) in fp16 and fp32 at two lengths (bf16 is refused where the kernels run under the
    interpreter: tests/test_cli.py)."""
    out = tmp_path_factory.mktemp("report")
    result = run_cli("report", "--formulations", "gla", "--dtypes", "float16,float32", "--lengths", "8,16",
                     "--device", "cpu", "--out", str(out), "--mpmath-check-max-T", "8", *TINY)
    return out, result


def test_report_writes_json_plots_and_index(tiny_report):
    out, result = tiny_report
    assert result.returncode == 0, result.stderr
    assert str(out / "index.md") in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert {"settings", "seed", "versions", "device", "oracle", "rows", "runs"} <= set(report)
    assert report["seed"] == 3 and report["device"]["type"] == "cpu"
    assert report["settings"]["lengths"] == [8, 16] and report["settings"]["formulations"] == ["gla"]
    assert {"torch", "triton", "attnlab"} <= set(report["versions"])
    rows = report["rows"]
    assert all(set(row) >= ROW_KEYS for row in rows)
    impls = {(row["impl"], row["dtype"]) for row in rows}
    assert impls == {("attnlab:chunkwise", "float16"), ("attnlab:recurrent", "float16"), ("fp32-recurrent", "float16"),
                     ("fp16-recurrent", "float16"), ("attnlab:chunkwise", "float32"), ("attnlab:recurrent", "float32"),
                     ("fp32-recurrent", "float32")}
    assert len(rows) == len(impls) * 2
    # A forward report is written as before there were passes: no pass field, no backward entry.
    assert all(not set(BACKWARD_KEYS) & set(row) for row in rows) and "backward" not in report
    assert "passes" not in report["settings"] and "--passes" not in report["settings"]["command"]
    for row in rows:
        if row["error"] is None:
            assert row["floor"] == max(row["floor_round"], row["floor_cond"])
            assert row["excess"] == pytest.approx(row["rel_err"] / row["floor"])
            assert row["nonfinite"] == 0 and row["oracle"] == "float64-chunkwise"
    baseline = next(r for r in rows if r["impl"] == "fp32-recurrent" and r["dtype"] == "float16")
    assert 0.9 <= baseline["excess"] <= 1.5  # fp32 accumulation, one rounding: at the floor
    # The float64 oracle is certified by mpmath at T <= 8 (first dtype only), not above.
    checks = report["oracle"]["mpmath_check"]
    assert checks["lengths"] == [8] and checks["max_rel_diff"] < 1e-12
    assert all((r["oracle_check"] is not None) == (r["T"] == 8 and r["dtype"] == "float16") for r in rows)


def test_every_row_is_graded_by_the_registry_bounds(tiny_report):
    """Each row records its verdict and the bounds it was graded by; index.md shows the worst verdict per line."""
    out, _ = tiny_report
    rows = json.loads((out / "report.json").read_text())["rows"]
    for row in rows:
        bounds = BOUNDS[row["dtype"]]
        assert (row["accuracy_bound"], row["correctness_bound"]) == (bounds.accuracy, bounds.correctness)
        expected = ("held" if row["excess"] <= bounds.accuracy else
                    "imprecise" if row["excess"] <= bounds.correctness else "failed")
        assert row["verdict"] == expected, row
    assert all(r["verdict"] == "held" for r in rows if r["impl"].startswith("attnlab:")), rows
    index = (out / "index.md").read_text()
    assert "| verdict |" in index and "*verdict* (the worst over T" in index
    assert f"float16: accuracy {BOUNDS['float16'].accuracy:g}, correctness {BOUNDS['float16'].correctness:g}" in index
    assert "Verdicts of attnlab's kernels over 8 points" in index


def test_index_links_every_plot_and_tabulates_every_implementation(tiny_report):
    out, _ = tiny_report
    index = (out / "index.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", index)
    assert links == ["gla.png"]
    for link in links:
        assert_png(out / link)
    for impl in ("attnlab:chunkwise", "attnlab:recurrent", "fp32-recurrent", "fp16-recurrent"):
        assert f"`{impl}`" in index
    assert "| formulation | impl | dtype | T=8 | T=16 |" in index
    assert "Reproduce: `attnlab report --formulations gla --dtypes float16,float32 --lengths 8,16" in index


def test_missing_kernel_module_is_an_error_row(tmp_path):
    """A kernel whose module cannot be imported fails its rows only; the baselines are still measured, and the
    command exits 1 (it did not measure every point asked for)."""
    hide_retnet_kernels = (
        "import sys\n"
        "sys.modules['attnlab.kernels.retnet'] = None  # importing it now raises ModuleNotFoundError\n"
        "from attnlab.cli import main\n"
        "sys.exit(main())\n"
    )
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", hide_retnet_kernels, "report", "--formulations", "retnet", "--dtypes", "float32",
         "--lengths", "8", "--device", "cpu", "--out", str(out), "--mpmath-check-max-T", "0", *TINY],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr
    rows = json.loads((out / "report.json").read_text())["rows"]
    kernels = [r for r in rows if r["impl"].startswith("attnlab:")]
    assert kernels and all(r["error"].startswith("ModuleNotFoundError") for r in kernels)
    assert [r["impl"] for r in rows if r["error"] is None] == ["fp32-recurrent"]
    assert_png(out / "retnet.png")
    assert "ModuleNotFoundError" in (out / "index.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (("report", "--formulations", "gla,flash"), "unknown formulation(s) flash"),
        (("report", "--dtypes", "float8"), "unknown dtype(s) float8"),
        (("report", "--lengths", "64,-5"), "lengths must be positive integers"),
        (("report", "--lengths", "0"), "lengths must be positive integers"),
        (("report", "--shape", "1,2,16"), "shape must be B,H,K,V"),
        (("report", "--passes", "nosuch"), "unknown pass(es) nosuch"),
        (("report", "--passes", "forward,sideways"), "unknown pass(es) sideways"),
        (("map", "delta", "--formulations", "gla"), "gla take(s) no part in the delta map"),
        (("map", "wobble"), "invalid choice: 'wobble'"),
        (("map", "gate", "--steps", "1"), "--steps must be at least 2"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(args, message, tmp_path):
    result = run_cli(*args, "--out", str(tmp_path))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not any(tmp_path.iterdir())


# --- the backward pass (report --passes backward) ----------------------------------------------------------------

BACKWARD_FORMULATIONS = ("gla", "kda")  # a gate per head and one per key channel; both forms of each have a backward


def attnlab_forms(name: str, with_backward: bool) -> list[str]:
    """attnlab's kernel forms of ``name`` with (or without) a backward."""
    return [form for form in attnlab.formulation(name).kernel_forms if (form in backward_forms(name)) == with_backward]
GRADIENTS = {n: [a.name for a in attnlab.formulation(n).args if a.differentiable] for n in BACKWARD_FORMULATIONS}


def gradient_bounds(dtype: str) -> tuple[float, float]:
    """(accuracy, correctness) of gradients in ``dtype``: the registry's gradient bounds, where it has them."""
    b = BOUNDS[dtype]
    return b.gradients


@pytest.fixture(scope="module")
def backward_report(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("backward")
    result = run_cli("report", "--passes", "backward", "--formulations", ",".join(BACKWARD_FORMULATIONS), "--dtypes", "float32",
                     "--lengths", "8,16", "--device", "cpu", "--out", str(out), *TINY)
    return out, result


def test_backward_rows_measure_every_gradient_of_every_differentiable_implementation(backward_report):
    """One row per gradient of fp32-recurrent (differentiable by autograd) and of attnlab's kernels with a backward,
    at each T, against float64 autograd through the chunkwise oracle: at the fp32 floor, graded held."""
    out, result = backward_report
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert all(r["pass"] == "backward" and set(r) >= ROW_KEYS | set(BACKWARD_KEYS) for r in rows)
    assert report["settings"]["passes"] == ["backward"] and "--passes backward" in report["settings"]["command"]
    measured = {(r["formulation"], r["impl"], r["T"], r["gradient"]) for r in rows}
    impls = {n: ["fp32-recurrent", *(f"attnlab:{form}" for form in attnlab_forms(n, True))] for n in GRADIENTS}
    assert measured == {(n, impl, T, g) for n, gs in GRADIENTS.items() for impl in impls[n] for T in (8, 16) for g in gs}
    assert any(impl.startswith("attnlab:") for _, impl, _, _ in measured)
    assert len(rows) == len(measured)
    for row in rows:
        assert row["error"] is None and row["nonfinite"] == 0 and row["ref_nonfinite"] == 0, row
        assert row["oracle"] == "float64-chunkwise-autograd" and row["dtype"] == "float32"
        assert row["floor"] == max(row["floor_round"], row["floor_cond"]) and 1e-9 < row["floor"] < 1e-6
        assert row["excess"] == pytest.approx(row["rel_err"] / row["floor"])
        # At the fp32 floor: fp32 accumulation measured 0.7 to 2.9; one rounding of an fp64 result (the delta rules'
        # chunkwise backward on fp32 inputs) 0.2 to 0.5; a reference compared with itself would read 0.
        assert 0.1 <= row["excess"] <= 4.0, row
        assert (row["accuracy_bound"], row["correctness_bound"]) == gradient_bounds("float32")
        assert row["verdict"] == "held"
    assert "chunkwise oracle" in report["backward"]["reference"]


def test_every_attnlab_kernel_is_measured_backward_and_none_listed_without_one(backward_report):
    """Every form of attnlab's kernels trains, so none is listed as having no backward (the listing itself, for an
    implementation whose output does not require grad, is tested in process below) and none failed."""
    out, result = backward_report
    report = json.loads((out / "report.json").read_text())
    assert all(attnlab_forms(n, False) == [] for n in BACKWARD_FORMULATIONS)
    assert report["backward"]["no_backward"] == [] and "no backward" not in result.stdout
    index = (out / "index.md").read_text()
    assert "No backward" not in index
    assert "failed" not in index.split("## Backward pass")[1].replace("*failed*", "")


def test_backward_figures_and_index_sections(backward_report):
    out, _ = backward_report
    index = (out / "index.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", index)
    assert links == ["gla-backward.png", "kda-backward.png"]
    for link in links:
        assert_png(out / link)
    assert not (out / "gla.png").exists() and "## Excess by length" not in index  # no forward pass run
    for heading in ("## Backward pass", "### Gradient excess by length", "### Gradient error vs T"):
        assert heading in index
    assert "| formulation | impl | dtype | gradient | T=8 | T=16 | verdict |" in index
    assert "| kda | `fp32-recurrent` | float32 | dbeta |" in index and "| gla | `attnlab:chunkwise` | float32 | dg |" in index
    assert "Reference: float64 autograd through the chunkwise oracle" in index


def test_backward_appended_to_a_forward_report_keeps_its_rows(tmp_path):
    """A forward report, then --passes backward --append: the forward rows stay as they were (no pass field),
    the backward rows (fp16: the fp16 and fp32 recurrences, attnlab's kernels) join them, and index.md has both
    passes."""
    common = ("--formulations", "gla", "--dtypes", "float16", "--lengths", "8", "--device", "cpu", "--out",
              str(tmp_path), "--mpmath-check-max-T", "0", *TINY)
    assert run_cli("report", *common).returncode == 0
    forward = json.loads((tmp_path / "report.json").read_text())["rows"]
    result = run_cli("report", "--passes", "backward", "--append", *common)
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [r for r in rows if "pass" not in r] == forward
    backward = [r for r in rows if r.get("pass") == "backward"]
    impls = ("fp32-recurrent", "fp16-recurrent", *(f"attnlab:{form}" for form in attnlab_forms("gla", True)))
    assert {(r["impl"], r["gradient"]) for r in backward} == {(i, g) for i in impls for g in GRADIENTS["gla"]}
    # fp32 inside, the gradient rounded once to fp16: the rounding floor itself (attnlab's kernels accumulate in fp32).
    at_the_floor = [r for r in backward if r["impl"] != "fp16-recurrent"]
    assert all(r["excess"] == pytest.approx(1.0, abs=0.05) and r["verdict"] == "held" for r in at_the_floor)
    # fp16 accumulation: above the floor (measured 2.4 to 3.2), but the right function.
    assert all(1.0 < r["excess"] < gradient_bounds("float16")[1] for r in backward if r["impl"] == "fp16-recurrent")
    index = (tmp_path / "index.md").read_text()
    assert "## Excess by length" in index and "## Backward pass" in index
    assert re.findall(r"!\[[^\]]*\]\(([^)]+)\)", index) == ["gla.png", "gla-backward.png"]


def test_a_backward_that_raises_is_a_failed_row_and_one_without_grad_is_listed():
    """In process: an implementation whose backward raises fails its row (with the message); one whose output
    does not require grad is recorded as having no backward, and skipped at later points."""
    from attnlab.commands.report import Sizes
    from attnlab.oracle import oracle
    from attnlab.registry import formulation

    class Broken(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("backward is broken")

    def raising(**x):
        o, state = oracle("gla", "recurrent", "float32")(**x)
        return Broken.apply(o), state

    def detached(**x):
        o, state = oracle("gla", "recurrent", "float32")(**x)
        return o.detach(), state.detach()

    no_backward: dict = {}
    impls = [Implementation("raising", lambda: raising), Implementation("detached", lambda: detached)]
    rows = measure_backward_point(formulation("gla"), "float32", 8, Sizes(1, 1, 8, 8), impls, no_backward, seed=0,
                                  device="cpu")
    assert [(r["impl"], r["verdict"]) for r in rows] == [("raising", "failed")]
    assert "RuntimeError: backward is broken" in rows[0]["error"] and rows[0]["pass"] == "backward"
    assert no_backward == {("gla", "detached"): "its output does not require grad"}


def test_a_reference_gradient_out_of_memory_fails_its_rows_with_what_to_change(monkeypatch, tmp_path, capsys):
    """The float64 reference of a long softmax row does not fit: `attnlab report --passes backward` records it in
    every implementation's row at that point, saying which option shrinks it, and exits 1 (a point raised)."""
    import attnlab.gradients
    from attnlab.cli import main

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB.")

    monkeypatch.setattr(attnlab.gradients, "oracle_gradients", out_of_memory)
    code = main(["report", "--passes", "backward", "--formulations", "softmax", "--dtypes", "float32", "--lengths",
                 "8", "--mpmath-check-max-T", "0", "--device", "cpu", "--out", str(tmp_path), *TINY])
    assert code == 1, capsys.readouterr()
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert rows and all(r["verdict"] == "failed" and "OutOfMemoryError" in r["error"] and "softmax's oracle" in r["error"]
                        and "--lengths" in r["error"] for r in rows), rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("command", [("report",), ("map", "shift")])
def test_cuda_without_a_gpu_exits_2(command, tmp_path):
    result = run_cli(*command, "--device", "cuda", "--out", str(tmp_path))
    assert result.returncode == 2 and "no CUDA GPU" in result.stderr, result.stderr


def test_map_writes_heatmaps_and_links_them_from_the_index(tmp_path):
    """A one-column shift map of rwkv4 in fp16 (four shifts): the naive exp(k) recurrence overflows past the threshold, the kernels do not."""
    result = run_cli("map", "shift", "--formulations", "rwkv4", "--dtypes", "float16", "--lengths", "8",
                     "--steps", "2", "--device", "cpu", "--out", str(tmp_path), *TINY)
    assert result.returncode == 0, result.stderr
    document = json.loads((tmp_path / "map-shift.json").read_text())
    rows = document["rows"]
    assert {r["impl"] for r in rows} == {"attnlab:chunkwise", "attnlab:recurrent", "fp32-recurrent", "fp16-recurrent"}
    assert all(set(r) >= ROW_KEYS | {"x", "y", "family"} for r in rows)
    shifts = document["axes"]["y"]["values"]
    assert min(shifts) == 0 and max(shifts) > 11.09
    naive = {r["y"]: r for r in rows if r["impl"] == "fp16-recurrent"}
    assert naive[0.0]["nonfinite"] == 0 and naive[max(shifts)]["nonfinite"] > 0
    assert all(r["nonfinite"] == 0 for r in rows if r["impl"].startswith("attnlab:"))
    figure = document["figures"][0]
    assert figure["png"] == "map-shift-rwkv4-T8.png" and figure["boundaries"][0]["ys"] == [pytest.approx(11.09, abs=0.01)]
    assert_png(tmp_path / figure["png"])
    index = (tmp_path / "index.md").read_text()
    assert "## Stability map: shift" in index and "](map-shift-rwkv4-T8.png)" in index


def test_map_append_adds_figures_replaces_redrawn_ones_and_refuses_another_grid(tmp_path):
    """A map built in two runs: the second run's formulation joins the first's; redrawing one replaces its rows."""
    common = ("--dtypes", "float16", "--lengths", "8", "--steps", "2", "--device", "cpu", "--out", str(tmp_path), *TINY)
    assert run_cli("map", "shift", "--formulations", "rwkv4", *common).returncode == 0
    assert run_cli("map", "shift", "--formulations", "aft", "--append", *common).returncode == 0
    document = json.loads((tmp_path / "map-shift.json").read_text())
    assert [g["formulation"] for g in document["figures"]] == ["rwkv4", "aft"]
    assert {r["formulation"] for r in document["rows"]} == {"rwkv4", "aft"} and len(document["runs"]) == 2
    per_run = len(document["rows"]) // 2
    assert run_cli("map", "shift", "--formulations", "aft", "--append", *common).returncode == 0
    again = json.loads((tmp_path / "map-shift.json").read_text())
    assert len(again["rows"]) == 2 * per_run and [g["formulation"] for g in again["figures"]] == ["rwkv4", "aft"]
    assert {r["run"] for r in again["rows"] if r["formulation"] == "aft"} == {2}
    index = (tmp_path / "index.md").read_text()
    assert index.count("reproduce: `attnlab map shift") == 3
    other_grid = run_cli("map", "shift", "--formulations", "aft", "--append", *common[:5], "3", *common[6:])
    assert other_grid.returncode == 2 and "was drawn on another grid" in other_grid.stderr


def test_growth_exponent_and_guides():
    assert growth_exponent([16, 64, 256], [1e-3, 2e-3, 4e-3]) == pytest.approx(0.5)
    assert growth_exponent([16, 64], [1e-3, None]) is None
    guides = textbook_guides([16, 4096], 2.0**-11)
    gamma, root = guides.values()
    assert gamma[0] == pytest.approx(16 * 2.0**-11 / (1 - 16 * 2.0**-11)) and gamma[1] != gamma[1]  # vacuous: NaN
    assert root == [pytest.approx(4 * 2.0**-11), pytest.approx(64 * 2.0**-11)]


def test_map_boundaries_take_the_kernels_chunk_size():
    """The gate map draws its overflow line at the kernel's chunk size; kda's "auto" (by shape) is drawn at the
    reference size, which is what it picks at the maps' B*H, and a fixed size is taken as it is."""
    from attnlab.kernel import kernel
    from attnlab.kernels.kda import auto_chunk_size
    from attnlab.commands.stability import MAP_DEFAULTS, kernel_chunk_size

    sizes = MAP_DEFAULTS["cuda"].sizes
    assert kernel_chunk_size("kda") == 64 == auto_chunk_size(sizes.B * sizes.H, 132)
    assert kernel_chunk_size("gla") == kernel("gla", "chunkwise").opts["chunk_size"]
