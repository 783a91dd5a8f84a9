"""The gpu-marked kernel tests, one process per formulation, so that one kernel's crash (an illegal memory
access poisons the CUDA context of its process) cannot fail every test after it.

    python3 tools/gpu/kernel_tests.py [NAME,NAME...] [--log DIR]

Prints one summary line per formulation (passed / failed counts and the first failure) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attnlab

TESTS = "tests/test_kernels.py"


def node_ids() -> list[str]:
    listing = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p", "no:cacheprovider", TESTS],
                             capture_output=True, text=True).stdout
    return [line.strip() for line in listing.splitlines() if line.startswith(TESTS + "::")]


def run_group(name: str, ids: list[str], log_dir: Path) -> tuple[str, int, str]:
    log = log_dir / f"kernel-tests-{name}.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids], capture_output=True, text=True, timeout=900)
    log.write_text(done.stdout + done.stderr)
    counts = re.findall(r"(\d+) (passed|failed|error)", done.stdout.splitlines()[-1] if done.stdout else "")
    first = next((line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    return f"{name:15s} {' '.join(f'{n} {w}' for n, w in counts) or 'no result'}  {first[:220]}", done.returncode, str(log)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="?", default=",".join(attnlab.names()))
    parser.add_argument("--log", default="out")
    args = parser.parse_args()
    log_dir = Path(args.log)
    log_dir.mkdir(parents=True, exist_ok=True)
    ids = node_ids()
    groups = {name: [i for i in ids if re.search(rf"\[{name}-", i)] for name in args.names.split(",")}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda item: run_group(item[0], item[1], log_dir), groups.items()))
    for line, _, _ in results:
        print(line, flush=True)
    return int(any(code != 0 for _, code, _ in results))


if __name__ == "__main__":
    sys.exit(main())
