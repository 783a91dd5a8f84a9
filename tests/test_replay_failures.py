"""tools/gpu/replay_failures.py, the replay of the property suite's failed or imprecise backward checks on the delta
rules with parts of the arithmetic forced: its log parsing, its patching (undone on the way out), and its command
line on a CPU log as a developer would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from attnlab.kernels import _delta_chunk_backward, _state_pass

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"
sys.path.insert(0, str(TOOLS))
import replay_failures as replay  # noqa: E402

CASE = "Case(name='deltanet', seed=3, B=1, T=20, H=1, K=16, V=16)"
LOG = f"""
E   AssertionError: property backward_matches_oracle[dq] FAILED for attnlab:deltanet/chunkwise in float32 on cpu
E     figure: gradient excess = rel_err / floor = 9.1    bound: 1.5 (held), 8 (failed above)
E     input: {CASE}
  properties/test_kernel_properties.py:21: ImpreciseWarning: property backward_split_and_resume[dk] IMPRECISE for attnlab:kda/chunkwise in bfloat16 on cuda
    figure: gradient excess = rel_err / floor = 4.54    bound: 1.5 (held), 8 (failed above)
    input: Case(name='kda', seed=52377, B=2, T=429, H=2, K=27, V=99, cut=331)
E   AssertionError: property backward_matches_oracle[dq] FAILED for attnlab:deltanet/chunkwise in float32 on cpu
E     input: {CASE}
"""


def test_failed_and_imprecise_checks_are_read_once_each():
    assert replay.failures(LOG) == [
        ("backward_matches_oracle[dq]", "deltanet", "chunkwise", "float32", CASE),
        ("backward_split_and_resume[dk]", "kda", "chunkwise", "bfloat16",
         "Case(name='kda', seed=52377, B=2, T=429, H=2, K=27, V=99, cut=331)"),
    ]


def test_forced_arithmetic_is_undone_on_the_way_out():
    chosen = (_delta_chunk_backward.products_precision(torch.bfloat16, 128, 128, 10**6),
              _delta_chunk_backward.wy_precision(torch.bfloat16, 128, 128),
              _state_pass.auto_precision(torch.bfloat16, 128, 128))
    with replay.arithmetic("tf32x3", "ieee"):
        assert _delta_chunk_backward.products_precision(torch.bfloat16, 128, 128, 10**6) == "tf32x3"
        assert _delta_chunk_backward.wy_precision(torch.bfloat16, 128, 128) == "tf32x3"
        assert _state_pass.auto_precision(torch.bfloat16, 128, 128) == "ieee"
    with replay.arithmetic("chosen"):
        assert _state_pass.auto_precision(torch.bfloat16, 128, 128) == chosen[2]
    assert (_delta_chunk_backward.products_precision(torch.bfloat16, 128, 128, 10**6),
            _delta_chunk_backward.wy_precision(torch.bfloat16, 128, 128),
            _state_pass.auto_precision(torch.bfloat16, 128, 128)) == chosen


def test_the_command_line_replays_a_cpu_log(tmp_path):
    """The log's deltanet entry alone (kda's case is too long for the interpreter): one line per variant, the forced
    forward named."""
    log = tmp_path / "properties.log"
    log.write_text(LOG.split("  properties/")[0])
    done = subprocess.run([sys.executable, str(TOOLS / "replay_failures.py"), str(log), "--device", "cpu",
                           "--variants", ":chosen,:tf32x3:ieee"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("backward_matches_oracle[dq]")]
    assert lines[0].startswith("backward_matches_oracle[dq] deltanet float32 chosen forward chosen: held"), lines
    assert lines[1].startswith("backward_matches_oracle[dq] deltanet float32 tf32x3 forward ieee: held"), lines
    assert done.stdout.startswith("1 failed or imprecise checks in"), done.stdout
