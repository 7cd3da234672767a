"""A synthetic, seeded ``vmtable.csv`` in the Azure Resource Central v2 layout.

SYNTHETIC: no row comes from Azure's published trace (not on this machine). The columns
are the published ones (``loadgen/readers/azure.py``), so ``read_azure`` reads the file
as it would the real one; the distributions are assumptions, chosen to be plausible for a
VM trace, not fitted to it:

- deployments arrive as a Poisson process (``rate_per_s``);
- a deployment's VM count: 1 with probability 0.5, else 2 + a geometric number (mean
  ``mean_extra_vms``), capped at ``max_vms`` (many singletons, a tail of tens);
- every VM of a deployment has the same size: core bucket 2 / 4 / 8 / 24 / >24 with
  probabilities 0.45 / 0.30 / 0.15 / 0.07 / 0.03, memory 4 GB per core's bucket
  (2 -> 8, 4 -> 32, 8 -> 32, 24 -> 64, >24 -> >64);
- lifetimes are log-normal (median ``median_lifetime_s``, sigma 1), each VM its own,
  created at the deployment's arrival;
- CPU utilisation columns are uniform draws (the simulators here do not read them).

``scripts/synth_vmtable.py`` writes one; ``megha-loadgen experiment gridiron`` makes its
own when given no Azure table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CORE_BUCKETS = ("2", "4", "8", "24", ">24")
CORE_P = (0.45, 0.30, 0.15, 0.07, 0.03)
MEMORY_BUCKET = {"2": "8", "4": "32", "8": "32", "24": "64", ">24": ">64"}


def synth_vmtable(
    path: str | Path,
    deployments: int = 400,
    seed: int = 0,
    rate_per_s: float = 0.05,
    mean_extra_vms: float = 6.0,
    max_vms: int = 60,
    median_lifetime_s: float = 3_600.0,
) -> Path:
    """Write ``deployments`` deployments' VMs to ``path`` (no header, as published);
    the same arguments write the same file."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate_per_s, deployments))
    single = rng.random(deployments) < 0.5
    extra = rng.geometric(1 / (1 + mean_extra_vms), deployments) - 1
    sizes = np.where(single, 1, np.minimum(2 + extra, max_vms))
    buckets = rng.choice(len(CORE_BUCKETS), size=deployments, p=CORE_P)
    lines = []
    vm = 0
    for d in range(deployments):
        n = int(sizes[d])
        lifetimes = np.maximum(60.0, rng.lognormal(np.log(median_lifetime_s), 1.0, n))
        cpu = rng.uniform(1, 100, (n, 3))
        core = CORE_BUCKETS[int(buckets[d])]
        created = float(arrivals[d])
        for i in range(n):
            avg, p95, peak = sorted(cpu[i])
            lines.append(
                f"vm{vm},sub{d % 37},dep{d},{created:.0f},{created + lifetimes[i]:.0f},"
                f"{peak:.2f},{avg:.2f},{p95:.2f},Unknown,{core},{MEMORY_BUCKET[core]}"
            )
            vm += 1
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
