"""``megha``: the operator CLI. Each subcommand is a thin shell over a library call."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("sizes must be positive integers")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megha", description="Megha: decentralized fair scheduling for federated clusters"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="micro-benchmarks of the scheduling hot path")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    bm = bench_kinds.add_parser("match", help="time one match on partitions of N nodes")
    bm.add_argument("--nodes", type=_sizes, default=(1_000, 5_000, 50_000), help="e.g. 1000,5000")
    bm.add_argument("--constraints", type=int, default=21, help="constraint vectors per node")
    bm.add_argument("--samples", type=int, default=2000, help="matches timed per size")
    bm.add_argument("--policy", default="first-fit", help="first-fit or best-fit")
    bm.add_argument("--seed", type=int, default=7)
    bm.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "match":
        from services.bench import bench_match, render_match

        if not 1 <= args.constraints <= 64:
            print("megha: --constraints must be in 1..64", file=sys.stderr)
            return 2
        results = bench_match(args.nodes, args.constraints, args.samples, args.policy, args.seed)
        print(render_match(results, args.json))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
