"""Write a SYNTHETIC, seeded Azure-format ``vmtable.csv`` (``loadgen/synth_azure.py``
says what is assumed: nothing in it comes from Azure's published trace).

Run from the repository root:

    python scripts/synth_vmtable.py OUT.csv [--deployments 400] [--seed 0]

The same arguments write the same file; ``megha-loadgen simulate OUT.csv`` (the name
must start with ``vmtable`` or pass ``--format azure``) reads it like the real table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loadgen.synth_azure import synth_vmtable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--deployments", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate-per-s", type=float, default=0.05, help="deployment arrivals")
    args = parser.parse_args()
    path = synth_vmtable(args.out, args.deployments, args.seed, args.rate_per_s)
    print(f"wrote {path} (synthetic, seed {args.seed})")


if __name__ == "__main__":
    main()
