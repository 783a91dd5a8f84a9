"""The ``attnlab`` command line: ``list``, ``bench``, ``report``, ``map``, ``selftest``, ``validate`` and ``campaign``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch

from attnlab.commands import campaign, report, selftest, stability, validate
from attnlab.kernel import backward_forms
from attnlab.oracle import PRECISIONS
from attnlab.registry import REGISTRY, names


def _kernel_forms(name: str) -> list[str]:
    f = next(f for f in REGISTRY if f.name == name)
    if importlib.util.find_spec(f.kernel_module) is None:
        return []
    return list(f.kernel_forms)


def list_table() -> str:
    rows = [("#", "formulation", "title", "oracle forms", "precisions", "kernels", "kernels' backward", "state")]
    for index, f in enumerate(REGISTRY, 1):
        state = ", ".join(f.state.names) if f.state else "none"
        forms = _kernel_forms(f.name)
        rows.append((str(index), f.name, f.title, ", ".join(f.forms), ", ".join(PRECISIONS), ", ".join(forms) or "none",
                     ", ".join(backward_forms(f.name) if forms else ()) or "none", state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _names_arg(text: str) -> list[str]:
    if text == "all":
        return names()
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown formulation(s) {', '.join(unknown)}; expected 'all' or some of {', '.join(names())}")
    return chosen


def cmd_list(args: argparse.Namespace) -> int:
    print(list_table())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("attnlab bench needs a CUDA GPU: triton.testing.do_bench times device events, "
              "and the interpreter's timings would mean nothing.", file=sys.stderr)
        return 2
    from attnlab.commands import bench
    from attnlab.evaluate import parse_dtype

    dtype = parse_dtype(args.dtype)
    import triton

    header = {
        "device": torch.cuda.get_device_name(),
        "shape": f"B={args.B}, T={args.T}, H={args.H}, K={args.K}, V={args.V}, {args.dtype}, {args.form} kernels",
        "passes": ", ".join(bench.PASS_LABELS[p] for p in args.passes),
        "versions": f"torch {torch.__version__}, triton {triton.__version__}, fla {_version('fla-core')}, python {platform.python_version()}",
        "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms) after one warm-up call",
    }
    rows: list[dict] = []
    for name in args.formulations:  # the table is rewritten after each formulation: a cut-short run keeps its rows
        rows += bench.run([name], B=args.B, T=args.T, H=args.H, K=args.K, V=args.V, dtype=dtype, form=args.form,
                          passes=args.passes)
        text = bench.markdown(rows, header)
        if args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            out.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=2, default=str))
    print(text)
    failed = [r["formulation"] for r in rows if r.get("error")]
    if failed:
        print(f"bench: {len(failed)} kernel setting(s) raised ({', '.join(dict.fromkeys(failed))}); see the table",
              file=sys.stderr)
    return 1 if failed else 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnlab", description="numerical-analysis and property-testing lab for attention")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the formulations with their forms, precisions and kernels, and which kernels have a backward").set_defaults(func=cmd_list)

    bench = sub.add_parser("bench", help="time each kernel side by side with its peer (GPU)")
    bench.add_argument("--formulations", type=_names_arg, default=names(), help="'all' or a comma-separated list")
    bench.add_argument("--form", default="chunkwise", choices=["chunkwise", "recurrent"])
    bench.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    for dim, default in (("B", 8), ("T", 4096), ("H", 16), ("K", 128), ("V", 128)):
        bench.add_argument(f"-{dim}", type=int, default=default)
    bench.add_argument("--passes", type=report.passes_arg, default=[report.FORWARD],
                       help="comma-separated: forward, backward (forward and backward together, as in training; "
                            "with forward too, the table gives the backward / forward); default forward")
    bench.add_argument("--out", help="write the table as Markdown here (and .json beside it)")
    bench.set_defaults(func=cmd_bench)
    report.add_parser(sub)
    stability.add_parser(sub)
    selftest.add_parser(sub)
    validate.add_parser(sub)
    campaign.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
