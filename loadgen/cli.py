"""``megha-loadgen``: trace replay and simulation (subcommands arrive with the load
generator issue; for now it only describes itself)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="megha-loadgen",
        description="Replay traces against a Megha federation or the in-process simulator.",
    )


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    build_parser().print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
