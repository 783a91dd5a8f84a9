"""Run one gradient check's case again, alone, to name the launch that faults on it (under ``compute-sanitizer`` or
with ``CUDA_LAUNCH_BLOCKING=1``).

    python3 tools/gpu/fault_case.py "$(awk -F'\\t' '$1 == "gw3"' $OUT/cases.log | tail -1)" [DEVICE, default cuda]

The argument is a line of tools/gpu/failure_log.py's cases log: worker, label (attnlab:NAME/FORM), dtype, mode, chunk
size, case, tab-separated (the worker may be left out). Every Triton launch is followed by a synchronization (Triton's
launch exit hook) that names the kernel when the GPU reports a fault: an asynchronous fault otherwise surfaces at a
later call. Prints the gradients' peaks, or the faulting kernel and the error with its traceback.
"""

from __future__ import annotations

import sys
import traceback

import torch
import triton

from attnlab.properties import checks
from attnlab.properties.strategies import Case  # noqa: F401 - the logged Case is evaluated against it
from attnlab.properties.targets import own_kernel_target


def _synchronize_after_each_launch() -> None:
    def exit_hook(metadata) -> None:
        try:
            torch.cuda.synchronize()
        except Exception:
            name = metadata.get().get("name") if hasattr(metadata, "get") else metadata
            print(f"fault in the launch of {name}", flush=True)
            raise

    triton.knobs.runtime.launch_exit_hook = exit_hook


def case_fields(line: str) -> tuple[str, str, str, str, str]:
    """(label, dtype, mode, chunk size, case) of a cases-log line, with or without its leading worker field."""
    fields = line.rstrip("\n").split("\t")
    if len(fields) == 6:
        fields = fields[1:]
    if len(fields) != 5 or not fields[0].startswith("attnlab:"):
        raise SystemExit(f"not a line of failure_log's cases log (worker, label, dtype, mode, chunk size, case, "
                         f"tab-separated): {line!r}")
    label, dtype, mode, chunk_size, case_text = fields
    return label, dtype, mode, chunk_size, case_text


def main() -> int:
    label, dtype, mode, chunk_size, case_text = case_fields(sys.argv[1])
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    name, form = label.removeprefix("attnlab:").split("/")
    case = eval(case_text)  # noqa: S307 - the suite's own repr of a Case
    if device == "cuda":
        _synchronize_after_each_launch()
    try:
        run = checks.gradient_run(own_kernel_target(name, form), case, getattr(torch, dtype), device, mode,
                                  eval(chunk_size))  # noqa: S307
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the point is to print it
        traceback.print_exc()
        return 1
    print(label, dtype, mode, run.error or {k: float(v.abs().max()) if isinstance(v, torch.Tensor) else None
                                            for k, v in run.grads.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
