"""Replay the property suite's failed backward checks on the delta rules with each product precision.

Reads a pytest log of the property suite (``--tb=short`` keeps each check's message: ``property P FAILED for
attnlab:NAME/FORM in DTYPE on DEVICE`` and its ``input: Case(...)`` line; imprecise checks' warnings too), and
reruns every such gradient check of attnlab's chunkwise delta-rule kernels on the same case in each VARIANT,
DTYPE:PRECISION[:FORWARD]: the inputs in DTYPE (the logged one when empty); the backward's products as the kernel
chooses them ("chosen": kernels/_delta_chunk_backward.products_precision, "fp16" for bf16 inputs) or forced
("tf32x3" forces W = T Kg and U = T V to it too: wy_precision); and the forward's state pass as "auto" chooses it
(FORWARD left out or "chosen": kernels/_state_pass.auto_precision) or forced ("ieee"). Where the check holds with
tf32x3 and not with "fp16", the backward's "fp16" path is the cause; where it holds only with the forward forced
too, the forward's (a split run's second call starts from the first's state); where it fails in fp16 inputs too,
no rounding of bf16's is.

    python3 tools/gpu/replay_failures.py properties.log [--variants :chosen,:tf32x3,:chosen:ieee,float16:chosen]

A developer's instrument (tools/gpu/README.md); prints one line per (check, precision).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Iterator

import torch

from attnlab.kernels import _delta_chunk_backward, _state_pass
from attnlab.properties import checks
from attnlab.properties.strategies import Case  # noqa: F401 - the logged Cases are evaluated against it
from attnlab.properties.targets import own_kernel_target

HEADER = re.compile(r"property (?P<prop>\S+) (?:FAILED|IMPRECISE)\S* .*?for attnlab:(?P<name>\w+)/(?P<form>\w+) "
                    r"in (?P<dtype>\w+) on (?P<device>\w+)")
INPUT = re.compile(r"input: (?P<case>Case\(.*\))\s*$")
CHECK = re.compile(r"(?P<base>\w+)\[(?P<gradient>\w+)\]")


@contextlib.contextmanager
def arithmetic(precision: str, forward: str = "chosen") -> Iterator[None]:
    """Inside the block, the delta backward's products at ``precision`` ("chosen": as products_precision chooses;
    "tf32x3" also W = T Kg and U = T V) and the forward's state pass at ``forward`` ("chosen": as auto_precision
    chooses), with the gradient checks' cached runs dropped (they are cached by case, not by the arithmetic)."""
    chosen = (_delta_chunk_backward.products_precision, _delta_chunk_backward.wy_precision,
              _state_pass.auto_precision)
    if precision != "chosen":
        _delta_chunk_backward.products_precision = lambda *_: precision
    if precision == "tf32x3":
        _delta_chunk_backward.wy_precision = lambda *_: precision
    if forward != "chosen":
        _state_pass.auto_precision = lambda *_: forward
    checks._GRADIENT_RUNS.clear()
    try:
        yield
    finally:
        (_delta_chunk_backward.products_precision, _delta_chunk_backward.wy_precision,
         _state_pass.auto_precision) = chosen
        checks._GRADIENT_RUNS.clear()


def failures(log: str) -> list[tuple[str, str, str, str, str]]:
    """(property, name, form, dtype, case text) of every failed or imprecise check in ``log``, once each."""
    found: list[tuple[str, str, str, str, str]] = []
    header = None
    for line in log.splitlines():
        line = re.sub(r"^E\s+", "", line.strip())
        if (m := HEADER.search(line)) is not None:
            header = m
        elif header is not None and (m := INPUT.search(line)) is not None:
            item = (header["prop"], header["name"], header["form"], header["dtype"], m["case"])
            if item not in found:
                found.append(item)
            header = None
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--variants", default=":chosen,:tf32x3,:chosen:ieee,:tf32x3:ieee,float16:chosen")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with open(args.log) as f:
        items = failures(f.read())
    print(f"{len(items)} failed or imprecise checks in {args.log}", flush=True)
    for prop, name, form, dtype_name, case_text in items:
        check = CHECK.fullmatch(prop)
        if check is None or form != "chunkwise":
            continue
        case = eval(case_text)  # noqa: S307 - the suite's own repr of a Case
        target = own_kernel_target(name, form)
        run = getattr(checks, f"check_{check['base']}")
        for variant in args.variants.split(","):
            dtype, precision, forward = (variant.split(":") + ["chosen"])[:3]
            dtype = dtype or dtype_name
            try:
                with arithmetic(precision, forward):
                    result = run(target, case, getattr(torch, dtype), args.device, check["gradient"])
                verdict = f"{result.verdict} figure {result.figure:.4g} ({result.detail[:160]})"
            except Exception as error:  # noqa: BLE001 - report and go on to the next
                verdict = f"raised {type(error).__name__}: {error}"
            print(f"{prop} {name} {dtype} {precision} forward {forward}: {verdict}\n    {case_text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
