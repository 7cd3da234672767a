"""VM traces for the lifetime-aware placement simulator (``megha-loadgen vm-sim``).

A ``VmTrace`` is one row per VM: arrival time, lifetime, shape and string features (the
inputs of the lifetime model). Two sources: a synthetic generator with the properties the
LAVA paper reports for production clouds, and a CSV file of this module's format.

Inputs, by ``read_vm_trace`` (``vm-sim --trace``, ``megha predictor train --trace``):
this module's CSV, or Azure Resource Central's ``vmtable.csv`` (``azure_vm_trace``),
told apart by the first line.

CSV format (header required, one VM per line)::

    vm_id,arrival_s,lifetime_s,cpu_milli,memory_mb,<feature>,<feature>,...

The first five columns are fixed; every further column is a lifetime-model feature whose
name is the header and whose value is a string (empty = missing). ``arrival_s`` is
seconds from the start of the trace, ``lifetime_s`` > 0.

The synthetic trace (``synthetic_vm_trace``):
- a population of users of three kinds: ``batch`` (almost only short VMs), ``service``
  (mostly long VMs) and ``mixed`` (both, from the *same* features: the lifetimes of one
  feature group are bimodal, so only uptime can tell the two modes apart);
- short VMs live minutes (log-normal, median 1.5-12 min per user), long ones hours to
  weeks (log-normal, median 4-72 h per user, sigma 1);
- VMs come in deployments, as in Azure, where a deployment's VMs are created together
  and torn down together: P(k VMs) ~ 1/k^2 up to 32 (62 % single VMs), one user, shape
  and lifetime draw per deployment, each VM created within a minute and living within a
  log-normal spread of 0.1 around the deployment's lifetime (``deployments=False``: every
  VM on its own, the trace before deployments, draw for draw);
- about 88 % of VMs live under 1 h, yet about 98 % of core-hours are in VMs of 1 h or
  more (the paper's production numbers; ``trace_properties`` measures both);
- arrivals are Poisson with a +-30 % diurnal swing; shapes are Azure-like (1-16 cores,
  2-8 GiB per core), a few per user;
- features: ``user``, ``category`` (interactive / delay-insensitive / unknown, noisy),
  ``priority`` (regular / spot), ``cores``, ``memory_gb``, ``deployment_size``; VM ids
  are ``d<deployment>-<k>``.
The user population comes from ``population_seed`` and the VMs from ``seed``, so a model
can be trained on one sample and evaluated on another of the same population.
"""

from __future__ import annotations

import csv
import gzip
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.readers.azure import read_azure_vms
from loadgen.trace import ReadStats, TraceError, open_text

DAY_S = 86_400.0
HOUR_S = 3_600.0
FIXED_COLUMNS = ("vm_id", "arrival_s", "lifetime_s", "cpu_milli", "memory_mb")

# (cores, GiB): general purpose (4 GiB/core), compute (2) and memory optimised (8).
SHAPES = (
    (1, 2), (1, 4), (2, 4), (2, 8), (2, 16), (4, 8), (4, 16), (4, 32),
    (8, 16), (8, 32), (8, 64), (16, 32), (16, 64), (16, 128),
)  # fmt: skip
# Users of each kind, their share of users and of VM creations, and P(long VM).
KINDS = {
    #          users  creations  p_long range
    "batch": (0.40, 0.655, (0.0, 0.02)),
    "mixed": (0.35, 0.275, (0.05, 0.35)),
    "service": (0.25, 0.07, (0.55, 0.90)),
}
SHORT_MEDIAN_MIN = (1.5, 12.0)  # per-user median of the short mode, minutes
LONG_MEDIAN_H = (4.0, 72.0)  # per-user median of the long mode, hours
SHORT_SIGMA, LONG_SIGMA = 0.9, 1.0  # log-normal spread of one deployment's lifetime
# Deployments (VMs one user creates together): P(k VMs) proportional to 1 / k^2 for k = 1..32
# (62 % single VMs, mean 2.5); the VMs of one deployment live alike, within this spread
# (the sigma of a log-normal factor per VM around the deployment's lifetime).
DEPLOYMENT_MAX = 32
DEPLOYMENT_SPREAD = 0.1
CATEGORY = {"batch": "delay-insensitive", "mixed": "unknown", "service": "interactive"}


@dataclass
class VmTrace:
    """VMs sorted by arrival. ``features`` maps a feature name to one string per VM."""

    arrival_s: np.ndarray
    lifetime_s: np.ndarray
    cpu_milli: np.ndarray
    memory_mb: np.ndarray
    features: dict[str, np.ndarray]
    vm_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if self.vm_ids is None:
            self.vm_ids = np.array([f"vm{i}" for i in range(n)], dtype=object)
        for name, column in (
            ("lifetime_s", self.lifetime_s),
            ("cpu_milli", self.cpu_milli),
            ("memory_mb", self.memory_mb),
            ("vm_ids", self.vm_ids),
            *self.features.items(),
        ):
            if len(column) != n:
                raise TraceError(f"column {name} has {len(column)} values for {n} VMs")
        order = np.argsort(self.arrival_s, kind="stable")
        if not np.array_equal(order, np.arange(n)):
            self.arrival_s = self.arrival_s[order]
            self.lifetime_s = self.lifetime_s[order]
            self.cpu_milli = self.cpu_milli[order]
            self.memory_mb = self.memory_mb[order]
            self.vm_ids = self.vm_ids[order]
            self.features = {k: v[order] for k, v in self.features.items()}

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def shapes(self) -> np.ndarray:
        """(VMs, 2) float: cpu_milli, memory_mb."""
        return np.column_stack([self.cpu_milli, self.memory_mb]).astype(np.float64)

    def feature_dicts(self, rows: np.ndarray | None = None) -> list[dict[str, str]]:
        rows = np.arange(len(self)) if rows is None else rows
        names = list(self.features)
        columns = [self.features[k][rows] for k in names]
        return [
            {k: v for k, v in zip(names, values, strict=True) if v != ""}
            for values in zip(*columns, strict=True)
        ]

    def subset(self, rows: np.ndarray) -> VmTrace:
        return VmTrace(
            self.arrival_s[rows],
            self.lifetime_s[rows],
            self.cpu_milli[rows],
            self.memory_mb[rows],
            {k: v[rows] for k, v in self.features.items()},
            self.vm_ids[rows],
        )


def synthetic_vm_trace(
    vms: int = 40_000,
    days: float = 10.0,
    seed: int = 0,
    population_seed: int = 42,
    users: int = 80,
    prehistory_days: int = 30,
    deployments: bool = True,
) -> VmTrace:
    """A synthetic VM trace with the properties in the module doc.

    About ``vms`` VMs arrive in ``[0, days)``. So that the fleet starts in steady state
    rather than empty, arrivals are drawn from ``prehistory_days`` before 0 as well and
    the VMs still running at 0 are kept, with negative arrival times.
    """
    if vms < 1 or days <= 0 or users < 3 or prehistory_days < 0:
        raise ValueError("need vms >= 1, days > 0, users >= 3 and prehistory_days >= 0")
    pop = _population(np.random.default_rng(population_seed), users)
    rng = np.random.default_rng(seed)
    sizes = _deployment_sizes(rng, vms, deployments)
    starts = _diurnal_arrivals(rng, len(sizes), days * DAY_S)
    if prehistory_days:
        before = _deployment_sizes(rng, round(vms * prehistory_days / days), deployments)
        earlier = _diurnal_arrivals(rng, len(before), prehistory_days * DAY_S)
        starts = np.concatenate([earlier - prehistory_days * DAY_S, starts])
        sizes = np.concatenate([before, sizes])
    # Per deployment: one user, one mode, one lifetime draw and one shape; its VMs are
    # created within a minute and live alike (a small per-VM spread).
    nd = len(sizes)
    dep = np.repeat(np.arange(nd), sizes)
    vms = len(dep)
    d_user = rng.choice(users, size=nd, p=pop["weight"])
    d_long = rng.random(nd) < pop["p_long"][d_user]
    median_h = np.where(d_long, pop["long_median_h"][d_user], pop["short_median_h"][d_user])
    sigma = np.where(d_long, LONG_SIGMA, SHORT_SIGMA)
    d_life = median_h * HOUR_S * np.exp(sigma * rng.standard_normal(nd))
    lifetime, arrival = d_life[dep], starts[dep]
    if deployments:
        lifetime = lifetime * np.exp(DEPLOYMENT_SPREAD * rng.standard_normal(vms))
        # Created within a minute of each other, on the same side of time 0.
        offset = rng.uniform(0, 60.0, vms)
        arrival = arrival + np.where(arrival < 0, -offset, offset)
    lifetime = np.clip(lifetime, 60.0, 2000 * HOUR_S)
    user = d_user[dep]
    # Each user has a few shapes; one is picked per deployment.
    # Long-lived VMs lean to a user's bigger shapes (services are sized up, batch is not).
    pick = rng.integers(0, 3, size=nd)
    pick = np.where(d_long, np.maximum(pick, rng.integers(0, 3, size=nd)), pick)
    shape = pop["shapes"][d_user, pick][dep]
    cores = np.array(SHAPES)[shape, 0]
    gib = np.array(SHAPES)[shape, 1]
    kind = pop["kind"][user]
    # The category a user declares is its kind's most of the time, but not always.
    category = np.array([CATEGORY[k] for k in kind], dtype=object)
    noisy = rng.random(vms) < 0.15
    category[noisy] = rng.choice(list(CATEGORY.values()), size=int(noisy.sum()))
    priority = np.where(pop["spot"][user] & (rng.random(vms) < 0.7), "spot", "regular")
    nth = np.arange(vms) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # "d<deployment>-<nth>"
    trace = VmTrace(
        arrival_s=arrival,
        lifetime_s=lifetime,
        cpu_milli=(cores * 1000).astype(np.int64),
        memory_mb=(gib * 1024).astype(np.int64),
        features={
            "user": np.array([f"u{u:03d}" for u in user], dtype=object),
            "category": category,
            "priority": priority.astype(object),
            "cores": cores.astype(str).astype(object),
            "memory_gb": gib.astype(str).astype(object),
            "deployment_size": sizes[dep].astype(str).astype(object),
        },
        vm_ids=np.array([f"d{d}-{k}" for d, k in zip(dep, nth, strict=True)], dtype=object),
    )
    # VmTrace sorted the VMs by arrival: filter on its columns, not on the arrays above.
    return trace.subset(np.flatnonzero(trace.arrival_s + trace.lifetime_s > 0))


def _population(rng: np.random.Generator, users: int) -> dict[str, np.ndarray]:
    kinds = list(KINDS)
    counts = [max(1, round(KINDS[k][0] * users)) for k in kinds]
    counts[0] = users - sum(counts[1:])
    kind = np.repeat(np.array(kinds, dtype=object), counts)
    weight = np.empty(users)
    p_long = np.empty(users)
    for k in kinds:
        members = kind == k
        # Zipf-like activity within a kind; the kind's total share is fixed.
        w = 1.0 / np.arange(1, members.sum() + 1) ** 0.8
        weight[members] = KINDS[k][1] * rng.permutation(w) / w.sum()
        lo, hi = KINDS[k][2]
        p_long[members] = rng.uniform(lo, hi, members.sum())
    return {
        "kind": kind,
        "weight": weight / weight.sum(),
        "p_long": p_long,
        "short_median_h": np.exp(
            rng.uniform(np.log(SHORT_MEDIAN_MIN[0]), np.log(SHORT_MEDIAN_MIN[1]), users)
        )
        / 60,
        "long_median_h": np.exp(
            rng.uniform(np.log(LONG_MEDIAN_H[0]), np.log(LONG_MEDIAN_H[1]), users)
        ),
        "shapes": np.sort(rng.choice(len(SHAPES), (users, 3), replace=True), axis=1),
        "spot": (kind == "batch") & (rng.random(users) < 0.5),
    }


def _deployment_sizes(rng: np.random.Generator, vms: int, deployments: bool) -> np.ndarray:
    """Sizes of deployments that add up to exactly ``vms`` VMs (the last one cut)."""
    if not deployments or vms <= 0:
        return np.ones(max(vms, 0), dtype=np.int64)
    k = np.arange(1, DEPLOYMENT_MAX + 1)
    p = 1.0 / k**2
    sizes = rng.choice(k, size=vms, p=p / p.sum())  # at least one VM each: enough
    total = np.cumsum(sizes)
    last = int(np.searchsorted(total, vms))
    sizes = sizes[: last + 1].copy()
    sizes[-1] -= total[last] - vms
    return sizes


def _diurnal_arrivals(rng: np.random.Generator, n: int, span_s: float) -> np.ndarray:
    """Poisson arrivals whose rate swings +-30 % over a day (thinning)."""
    out = np.empty(0)
    while len(out) < n:
        t = rng.uniform(0, span_s, 2 * n)
        keep = rng.random(2 * n) < (1 + 0.3 * np.sin(2 * np.pi * t / DAY_S)) / 1.3
        out = np.concatenate([out, t[keep]])
    return np.sort(out[:n])


def trace_properties(trace: VmTrace) -> dict[str, float]:
    """The shares the paper reports: VMs under 1 h, and core-hours in VMs of >= 1 h
    (over the VMs arriving from time 0 on; the prehistory's survivors are all long)."""
    trace = trace.subset(np.flatnonzero(trace.arrival_s >= 0))
    short = trace.lifetime_s < HOUR_S
    core_s = trace.cpu_milli * trace.lifetime_s
    return {
        "vms": float(len(trace)),
        "vms_under_1h": float(short.mean()),
        "core_hours_1h_plus": float(core_s[~short].sum() / core_s.sum()),
        "median_lifetime_s": float(np.median(trace.lifetime_s)),
    }


def write_vm_csv(trace: VmTrace, path: str | Path) -> Path:
    path = Path(path)
    names = list(trace.features)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*FIXED_COLUMNS, *names])
        for i in range(len(trace)):
            out.writerow(
                [
                    trace.vm_ids[i],
                    f"{trace.arrival_s[i]:.3f}",
                    f"{trace.lifetime_s[i]:.3f}",
                    int(trace.cpu_milli[i]),
                    int(trace.memory_mb[i]),
                    *(trace.features[k][i] for k in names),
                ]
            )
    return path


def read_vm_csv(path: str | Path) -> VmTrace:
    """Read the CSV format in the module doc; ``TraceError`` names the bad line."""
    path = Path(path)
    try:
        f = open_text(path)
    except OSError as err:
        raise TraceError(f"{path}: {err.strerror or err}") from None
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(header[:5]) != FIXED_COLUMNS:
            raise TraceError(f"{path}: the header must start with {','.join(FIXED_COLUMNS)}")
        names = header[5:]
        rows: list[list[str]] = []
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise TraceError(f"{path}:{line}: {len(row)} columns, header has {len(header)}")
            rows.append(row)
    if not rows:
        raise TraceError(f"{path}: no VMs")
    columns = list(zip(*rows, strict=True))
    try:
        numbers = [np.array(columns[i], dtype=np.float64) for i in range(1, 5)]
    except ValueError as err:
        raise TraceError(f"{path}: a number column holds a non-number ({err})") from None
    arrival, lifetime, cpu, mem = numbers
    bad = np.flatnonzero(~(lifetime > 0) | (cpu < 0) | (mem < 0) | ~np.isfinite(arrival))
    if len(bad):
        raise TraceError(f"{path}:{bad[0] + 2}: lifetime_s must be > 0 and the shape non-negative")
    return VmTrace(
        arrival_s=arrival,
        lifetime_s=lifetime,
        cpu_milli=cpu.astype(np.int64),
        memory_mb=mem.astype(np.int64),
        features={n: np.array(columns[5 + i], dtype=object) for i, n in enumerate(names)},
        vm_ids=np.array(columns[0], dtype=object),
    )


AZURE_RESOLUTION_S = 300.0  # vmtable timestamps are multiples of 5 minutes


def azure_vm_trace(
    path: str | Path, max_vms: int | None = None, stats: ReadStats | None = None
) -> VmTrace:
    """Azure Resource Central's ``vmtable.csv`` (AzurePublicDatasetV2, plain or ``.gz``;
    columns in ``loadgen/readers/azure.py``) as a ``VmTrace``.

    - arrival = ``vmcreated``, lifetime = ``vmdeleted - vmcreated``; a VM created and
      deleted in the same 5-minute tick gets half a tick (150 s), since the table cannot
      tell. VMs still running when the table ends carry its last timestamp: their
      lifetimes are cut short there, as in the data. VMs created before the table
      begins, if they carry its first timestamp, arrive together at its start (vm-sim's
      warm-up keeps that burst out of the metrics).
    - shape: the core and memory buckets (``>24`` read as 32 cores, ``>64`` as 128 GB);
    - features, all known when a VM is created: ``user`` (the subscription),
      ``category``, ``cores`` and ``memory_gb`` (the buckets as published) and
      ``deployment_size`` (VMs of its deployment in the table, as in the synthetic
      trace). The CPU utilisation columns are measured over the VM's life, so they are
      not features.

    Malformed rows are skipped and counted in ``stats`` (file and line kept).
    """
    rows = list(read_azure_vms(path, max_vms=max_vms, stats=stats))
    if not rows:
        raise TraceError(f"{path}: no VMs")
    sizes: dict[str, int] = {}
    for vm in rows:
        sizes[vm.deployment_id] = sizes.get(vm.deployment_id, 0) + 1
    lifetime = np.array([vm.lifetime_s for vm in rows], dtype=np.float64)
    return VmTrace(
        arrival_s=np.array([vm.created_s for vm in rows], dtype=np.float64),
        lifetime_s=np.where(lifetime > 0, lifetime, AZURE_RESOLUTION_S / 2),
        cpu_milli=np.array([round(vm.cores * 1000) for vm in rows], dtype=np.int64),
        memory_mb=np.array([round(vm.memory_gb * 1024) for vm in rows], dtype=np.int64),
        features={
            "user": np.array([vm.subscription_id for vm in rows], dtype=object),
            "category": np.array([vm.category.lower() for vm in rows], dtype=object),
            "cores": np.array([vm.core_bucket for vm in rows], dtype=object),
            "memory_gb": np.array([vm.memory_bucket for vm in rows], dtype=object),
            "deployment_size": np.array(
                [str(sizes[vm.deployment_id]) for vm in rows], dtype=object
            ),
        },
        vm_ids=np.array([vm.vm_id for vm in rows], dtype=object),
    )


def write_azure_vmtable(trace: VmTrace, path: str | Path) -> Path:
    """Write ``trace`` in Azure's ``vmtable.csv`` layout (no header; ``.gz`` compresses),
    so the Azure path can be exercised at any size without the real table.

    VMs already running at time 0 (negative arrival) are written as created at 0, as
    Azure shows VMs older than its table. Times are rounded to whole seconds (Azure's own
    are 5-minute ticks). Shapes are written as numbers, not snapped to Azure's buckets.
    The utilisation columns are 0 (unknown), the category capitalised as Azure spells it,
    the deployment taken from ids ``d<deployment>-<k>`` (else each VM its own).
    """
    path = Path(path)
    start = np.maximum(np.round(trace.arrival_s), 0).astype(np.int64)
    end = np.maximum(np.round(trace.arrival_s + trace.lifetime_s).astype(np.int64), start + 1)
    user = trace.features.get("user", np.full(len(trace), "unknown", dtype=object))
    category = trace.features.get("category", np.full(len(trace), "unknown", dtype=object))
    gz = path.suffix == ".gz"
    with gzip.open(path, "wt", newline="") if gz else path.open("w", newline="") as f:
        out = csv.writer(f)
        for i, vm_id in enumerate(trace.vm_ids):
            out.writerow(
                [
                    vm_id,
                    user[i],
                    str(vm_id).rsplit("-", 1)[0] if str(vm_id).startswith("d") else vm_id,
                    start[i],
                    end[i],
                    0,
                    0,
                    0,
                    str(category[i]).capitalize(),
                    f"{trace.cpu_milli[i] / 1000:g}",
                    f"{trace.memory_mb[i] / 1024:g}",
                ]
            )
    return path


def read_vm_trace(path: str | Path, stats: ReadStats | None = None) -> VmTrace:
    """A VM trace in this module's CSV format or Azure's ``vmtable.csv``: a file whose
    first line starts with ``vm_id,arrival_s`` is ours, any other is read as Azure's."""
    path = Path(path)
    try:
        with open_text(path) as f:
            first = f.readline()
    except OSError as err:
        raise TraceError(f"{path}: {err.strerror or err}") from None
    if first.startswith(",".join(FIXED_COLUMNS[:2])):
        return read_vm_csv(path)
    return azure_vm_trace(path, stats=stats)


def group_lifetimes(trace: VmTrace, keys: tuple[str, ...]) -> Mapping[tuple, np.ndarray]:
    """Lifetimes per feature group (tests use it to show bimodality within a group)."""
    groups: dict[tuple, list[float]] = {}
    cols = [trace.features[k] for k in keys]
    for i, life in enumerate(trace.lifetime_s):
        groups.setdefault(tuple(c[i] for c in cols), []).append(float(life))
    return {k: np.array(v) for k, v in groups.items()}
