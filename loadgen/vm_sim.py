"""``megha-loadgen vm-sim``: an event-driven VM allocation simulator for the lifetime-aware
policies of ``services/core/lifetime.py`` (best-fit, LA-Binary, LAS, LAVA) with LARS
migrations, each run with the learned lifetime model and with an oracle.

Model of the world:
- a fixed pool of identical hosts (default 64 cores, 256 GiB; the count is sized from
  the trace: peak concurrent demand of the busier dimension / ``target_utilisation``);
- VMs arrive at their trace time and are placed at once by the policy (the same core
  classes the GM runs), or rejected when no host fits; they leave after their lifetime;
- the predictor is asked once per VM at arrival (uptime 0) and, every ``repredict_s``
  (default 1 h), again for every resident VM with its current uptime: LAS refreshes the
  hosts' exit times from these re-predictions, LAVA also uses them when a host's class
  deadline passes;
- rolling maintenance: every ``maintenance_interval_s`` the next host in index order
  starts draining (takes no new VMs); every ``migration_interval_s`` one VM is migrated
  off each draining host, chosen by LARS (longest predicted remaining lifetime first;
  ``--drain-order random`` for comparison) and placed by the same policy; the host is
  maintained the moment it is empty. Short VMs leave by themselves meanwhile, which is
  how the order saves migrations;
- metrics are sampled every ``sample_s`` (15 min) after ``warmup_s`` (2 days):
  empty hosts % (hosts without a VM), its ceiling (``ceiling``: 1 - the pool's
  utilisation of the busier dimension, what perfect packing would leave empty), and
  CPU / memory stranding by the inflation method: on each non-empty host the summed
  shape of its VMs is scaled up until one dimension is full; what is left free of the
  other dimension is stranded. Reported as a
  share of the pool's total capacity, averaged over the samples. Migrations are counted
  after the warm-up too.

Predictors: ``oracle`` knows each VM's true remaining lifetime; ``model`` is the trained
``LifetimeModel`` (given with ``--model``, or trained first on a separate sample of the
same synthetic population, or on the first 30 % of a CSV trace). With the model, LAS
(and LAVA's LAS step) score a host by the VM's *expected* extension of it over the
predicted distribution, E[max(R - h, 0)], read off the model's E[remaining] at the
uptimes ``now + h`` (``services.core.lifetime.extension_curve``); ``--extension mean``
scores the extension of the mean instead. ``--seeds N`` repeats the run on N samples of
the synthetic trace and reports the mean of each row.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from loadgen.trace import ReadStats
from loadgen.vm_trace import DAY_S, HOUR_S, VmTrace, read_vm_trace, synthetic_vm_trace
from services.common.argtypes import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from services.core.lifetime import (
    NO_HOST,
    HostPool,
    LaBinary,
    Lava,
    LifetimeEstimate,
    VmRequest,
    extension_buckets,
    extension_curve,
    lars_order,
    las_scores,
    make_lifetime_policy,
)
from services.predictor.lifetime_model import AUGMENT_GRID_S, ModelError

POLICY_NAMES = ("best_fit", "la_binary", "las", "lava")
# Horizons at which a VM's expected host-life extension is tabulated: 0 and the model's
# uptime grid (5 min x sqrt(2)^k, up to ~2,000 h).
EXTENSION_HORIZONS_S = np.concatenate([[0.0], AUGMENT_GRID_S])
PREDICTOR_NAMES = ("model", "oracle")


class SimPredictor(Protocol):
    """Expected remaining lifetime (s) of VMs (trace rows) at the given uptimes."""

    name: str

    def __call__(self, vms: np.ndarray, uptime_s: np.ndarray) -> np.ndarray: ...


class OraclePredictor:
    name = "oracle"

    def __init__(self, trace: VmTrace):
        self.lifetime_s = trace.lifetime_s

    def __call__(self, vms: np.ndarray, uptime_s: np.ndarray) -> np.ndarray:
        return np.maximum(self.lifetime_s[vms] - uptime_s, 0.0)


class ModelPredictor:
    """The learned model; features are encoded once, re-predictions only change uptime."""

    name = "model"

    def __init__(self, model, trace: VmTrace):
        self.model = model
        self.X = model.schema.encode_columns(trace.features, len(trace))

    def __call__(self, vms: np.ndarray, uptime_s: np.ndarray) -> np.ndarray:
        if len(vms) == 0:
            return np.empty(0)
        return self.model.predict_expected(self.X[vms], uptime_s)

    def extension(self, vms: np.ndarray, uptime_s: np.ndarray) -> np.ndarray:
        """Per VM, ``E[max(R - h, 0)]`` at the horizons ``EXTENSION_HORIZONS_S``, from the
        model's E[remaining] at the uptimes ``uptime + h`` (``extension_curve``)."""
        k = len(EXTENSION_HORIZONS_S)
        rows = np.repeat(vms, k)
        uptimes = (np.asarray(uptime_s, dtype=np.float64)[:, None] + EXTENSION_HORIZONS_S).ravel()
        mean_residual = self(rows, uptimes).reshape(len(vms), k)
        return extension_curve(EXTENSION_HORIZONS_S, mean_residual)


@dataclass(frozen=True)
class SimOptions:
    host_cpu_milli: int = 64_000
    host_memory_mb: int = 256 * 1024
    hosts: int = 0  # 0: sized from the trace
    target_utilisation: float = 0.85
    warmup_s: float = 2 * DAY_S  # as the CLI
    sample_s: float = 900.0
    repredict_s: float = HOUR_S
    maintenance_interval_s: float = 6 * HOUR_S  # 0: no maintenance
    migration_interval_s: float = 900.0
    drain_order: str = "lars"  # or "random"
    # LAS / LAVA extension cost: "distribution" (E[max(R - h, 0)] over the predicted
    # distribution, when the predictor has one) or "mean" (max(E[R] - h, 0))
    extension: str = "distribution"
    seed: int = 0


# The measured (float) fields of a SimResult: rounded in vm.json, averaged over seeds.
_MEASURED = (
    "empty_hosts_pct",
    "cpu_stranded_pct",
    "mem_stranded_pct",
    "empty_ceiling_pct",
    "wall_s",
)


@dataclass
class SimResult:
    policy: str
    predictor: str
    empty_hosts_pct: float
    cpu_stranded_pct: float
    mem_stranded_pct: float
    migrations: int
    empty_ceiling_pct: float = 0.0
    rejected: int = 0
    hosts: int = 0
    vms: int = 0
    wall_s: float = 0.0
    empty_hosts_pct_by_seed: list[float] | None = None  # with --seeds N > 1
    # LAVA only: per step (Lava.STEPS), [placements after the warm-up, of them those
    # that extend their host's life by a higher LAS bucket than LAS's own pick would,
    # and those on another host than LAS's pick]
    lava_steps: dict[str, list[int]] | None = None
    # LA-Binary only: its labels at creation against the true lifetimes (VM counts)
    labels: dict[str, int] | None = None

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        for key in _MEASURED:
            out[key] = round(out[key], 2)
        for key in ("empty_hosts_pct_by_seed", "lava_steps", "labels"):
            if out[key] is None:
                del out[key]
        return out


def size_pool(trace: VmTrace, options: SimOptions) -> int:
    """Hosts for the peak concurrent demand of the busier dimension at the target
    utilisation (the VMs' whole lifetimes, clipped to the trace's span)."""
    if options.hosts:
        return options.hosts
    end = trace.arrival_s.max()
    times = np.concatenate([trace.arrival_s, np.minimum(trace.arrival_s + trace.lifetime_s, end)])
    order = np.argsort(times, kind="stable")
    peak = []
    for demand in (trace.cpu_milli, trace.memory_mb):
        delta = np.concatenate([demand, -demand]).astype(np.float64)[order]
        peak.append(np.cumsum(delta).max())
    need = max(peak[0] / options.host_cpu_milli, peak[1] / options.host_memory_mb)
    return max(1, int(np.ceil(need / options.target_utilisation)))


def stranding(pool: HostPool) -> tuple[float, float]:
    """Inflation method: stranded CPU and memory as shares of the pool's capacity."""
    used = pool.used
    busy = np.any(used > 0, axis=1)
    if not busy.any():
        return 0.0, 0.0
    cap = pool.capacity[busy]
    u = used[busy]
    with np.errstate(divide="ignore"):
        factor = np.min(np.where(u > 0, cap / u, np.inf), axis=1)
    stranded = np.maximum(cap - u * factor[:, None], 0.0).sum(axis=0)
    total = pool.capacity.sum(axis=0)
    return float(stranded[0] / total[0]), float(stranded[1] / total[1])


def ceiling(pool: HostPool) -> float:
    """The most hosts any policy could keep empty now: 1 - the pool's utilisation of its
    busier dimension (identical hosts, VMs packed perfectly). The gap between a policy's
    empty hosts and this is its fragmentation; no policy can gain more than it."""
    return float(1.0 - (pool.used.sum(axis=0) / pool.capacity.sum(axis=0)).max())


def simulate(
    trace: VmTrace,
    policy_name: str,
    predictor: SimPredictor,
    options: SimOptions = SimOptions(),
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    """One policy with one predictor over the whole trace."""
    started = time.perf_counter()
    policy = make_lifetime_policy(policy_name)
    hosts = size_pool(trace, options)
    capacity = np.tile([options.host_cpu_milli, options.host_memory_mb], (hosts, 1))
    pool = HostPool(capacity, adaptive=policy.adaptive)
    shapes = trace.shapes
    n = len(trace)
    expected0 = predictor(np.arange(n), np.zeros(n))  # one batch: uptime 0 for every VM
    end_s = float(trace.arrival_s.max())
    rng = np.random.default_rng(options.seed)
    start_s = np.zeros(n)  # when each VM started (for uptimes)

    departures: list[tuple[float, int]] = []
    remaining_now: dict[int, float] = {}
    samples: list[tuple[float, float, float, float]] = []
    draining: set[int] = set()
    next_drain_host = 0
    migrations = rejected = 0
    next_sample = options.sample_s
    next_repredict = options.repredict_s
    next_maintenance = options.maintenance_interval_s or np.inf
    next_migration = options.migration_interval_s
    report_every = max(1, n // 100)

    # LAS / LAVA with the model: the expected extension over the predicted distribution.
    curves = None
    if (
        policy.uses_exits
        and options.extension == "distribution"
        and hasattr(predictor, "extension")
    ):
        curves = predictor.extension(np.arange(n), np.zeros(n))  # uptime 0, one batch

    # LAVA: which step placed each VM, and whether LAS would have extended a host less.
    steps = np.zeros((len(Lava.STEPS), 3), dtype=np.int64) if isinstance(policy, Lava) else None

    def place(vm: int, now: float, estimate_s: float, curve: np.ndarray | None = None) -> int:
        request = VmRequest(shapes[vm], now)
        if curve is None and curves is not None and now == start_s[vm]:
            curve = curves[vm]  # a new VM
        estimate = LifetimeEstimate(
            estimate_s,
            extension_horizons_s=None if curve is None else EXTENSION_HORIZONS_S,
            extension_s=curve,
        )
        if steps is None:
            host = policy.choose_host(pool, request, estimate)
        else:
            host, step = policy.choose(pool, request, estimate)
            if host != NO_HOST and now >= options.warmup_s:
                # LAS over the same hosts (Las.choose_host, without computing it twice).
                fits = np.flatnonzero(pool.fits(request.shape))
                buckets = extension_buckets(pool, fits, request, estimate)
                chosen = buckets[np.searchsorted(fits, host)]
                las = fits[np.argmin(las_scores(pool, fits, request, buckets))]
                steps[step] += (1, int(chosen > buckets.min()), int(host != las))
        if host != NO_HOST:
            pool.place(vm, host, shapes[vm], policy.tag(estimate), now + estimate_s, now)
        return host

    def repredict(now: float) -> None:
        nonlocal remaining_now
        residents = np.fromiter(pool.vm_host, dtype=np.int64, count=len(pool.vm_host))
        remaining = predictor(residents, now - start_s[residents])
        remaining_now = dict(zip(residents.tolist(), remaining.tolist(), strict=True))
        if policy.uses_exits:
            pool.update_exits({v: now + r for v, r in remaining_now.items()})

    def migrate_one(host: int, now: float) -> bool:
        vms = np.fromiter(pool.members[host], dtype=np.int64)
        if options.drain_order == "lars":
            order = lars_order(predictor(vms, now - start_s[vms]))
        else:
            order = rng.permutation(len(vms))
        vm = int(vms[order[0]])
        pool.release(vm, now)
        uptime = np.array([now - start_s[vm]])
        estimate_s = float(predictor(np.array([vm]), uptime)[0])
        curve = None if curves is None else predictor.extension(np.array([vm]), uptime)[0]
        if place(vm, now, estimate_s, curve) == NO_HOST:  # nowhere to go: stays, try later
            pool.available[host] = True
            tag = policy.tag(LifetimeEstimate(estimate_s))
            pool.place(vm, host, shapes[vm], tag, now + estimate_s, now)
            pool.available[host] = False
            return False
        return True

    i = 0
    while i < n or departures:
        t_arrival = trace.arrival_s[i] if i < n else np.inf
        t_departure = departures[0][0] if departures else np.inf
        t_tick = min(next_sample, next_repredict, next_maintenance, next_migration)
        now = min(t_arrival, t_departure, t_tick)
        if now > end_s:
            break
        if t_departure <= now:
            _, vm = heapq.heappop(departures)
            if vm in pool.vm_host:
                host = pool.release(vm, now)
                if host in draining and pool.vm_count[host] == 0:
                    draining.discard(host)
                    pool.available[host] = True
            continue
        if t_tick <= now:
            if next_repredict <= now:
                repredict(now)
                next_repredict += options.repredict_s
            if next_sample <= now:
                pool.advance(now, remaining_now)
                if now >= options.warmup_s:
                    cpu, mem = stranding(pool)
                    samples.append((float(pool.empty().mean()), cpu, mem, ceiling(pool)))
                next_sample += options.sample_s
            if next_maintenance <= now:
                host = next_drain_host % hosts
                next_drain_host += 1
                if host not in draining and pool.vm_count[host] > 0:
                    draining.add(host)
                    pool.available[host] = False
                next_maintenance += options.maintenance_interval_s
            if next_migration <= now:
                for host in sorted(draining):
                    if pool.vm_count[host] and migrate_one(host, now) and now >= options.warmup_s:
                        migrations += 1
                    if pool.vm_count[host] == 0:
                        draining.discard(host)
                        pool.available[host] = True
                next_migration += options.migration_interval_s
            continue
        vm = i
        i += 1
        start_s[vm] = now
        if place(vm, now, float(expected0[vm])) == NO_HOST:
            rejected += 1
        else:
            heapq.heappush(departures, (now + trace.lifetime_s[vm], vm))
        if progress is not None and i % report_every == 0:
            progress(i / n)
    if not samples:  # a trace shorter than the warm-up: measure at the end
        cpu, mem = stranding(pool)
        samples.append((float(pool.empty().mean()), cpu, mem, ceiling(pool)))
    empty, cpu, mem, most = (100.0 * x for x in np.mean(samples, axis=0))
    return SimResult(
        policy=policy_name,
        predictor=predictor.name,
        empty_hosts_pct=float(empty),
        cpu_stranded_pct=float(cpu),
        mem_stranded_pct=float(mem),
        migrations=migrations,
        empty_ceiling_pct=float(most),
        rejected=rejected,
        hosts=hosts,
        vms=n,
        wall_s=time.perf_counter() - started,
        lava_steps=None
        if steps is None
        else {name: steps[k].tolist() for k, name in enumerate(Lava.STEPS)},
        labels=label_confusion(expected0, trace.lifetime_s, policy.cutoff_s)
        if isinstance(policy, LaBinary)
        else None,
    )


def label_confusion(
    predicted_s: np.ndarray, lifetime_s: np.ndarray, cutoff_s: float
) -> dict[str, int]:
    """LA-Binary's one-shot labels (predicted lifetime >= cutoff: long) against the true
    lifetimes, as VM counts: ``long_as_short`` are long VMs it labelled short."""
    said_long = np.asarray(predicted_s) >= cutoff_s
    long = np.asarray(lifetime_s) >= cutoff_s
    return {
        f"{truth}_as_{said}": int(((long == t) & (said_long == p)).sum())
        for truth, t in (("long", True), ("short", False))
        for said, p in (("long", True), ("short", False))
    }


def run_all(
    trace: VmTrace,
    model,
    options: SimOptions = SimOptions(),
    policies: Sequence[str] = POLICY_NAMES,
    predictors: Sequence[str] = PREDICTOR_NAMES,
    progress: bool = False,
) -> list[SimResult]:
    """Every policy x predictor; ``model`` may be None when only the oracle runs."""
    made: dict[str, SimPredictor] = {"oracle": OraclePredictor(trace)}
    if "model" in predictors:
        made["model"] = ModelPredictor(model, trace)
    results = []
    for policy in policies:
        for name in predictors:
            show = _progress_line(f"{policy}/{name}") if progress else None
            results.append(simulate(trace, policy, made[name], options, show))
            if show is not None:
                sys.stderr.write("\n")
    return results


def average_runs(runs: Sequence[Sequence[SimResult]]) -> list[SimResult]:
    """One row per policy x predictor: the mean over runs (seeds) of every metric, with
    the per-run empty hosts % kept in ``empty_hosts_pct_by_seed``."""
    out = []
    for rows in zip(*runs, strict=True):
        first = rows[0]
        mean = {key: float(np.mean([getattr(r, key) for r in rows])) for key in _MEASURED}
        out.append(
            SimResult(
                policy=first.policy,
                predictor=first.predictor,
                migrations=round(float(np.mean([r.migrations for r in rows]))),
                rejected=sum(r.rejected for r in rows),
                hosts=round(float(np.mean([r.hosts for r in rows]))),
                vms=round(float(np.mean([r.vms for r in rows]))),
                empty_hosts_pct_by_seed=[round(r.empty_hosts_pct, 2) for r in rows],
                labels=None
                if first.labels is None
                else {k: sum(r.labels[k] for r in rows) for k in first.labels},
                lava_steps=None
                if first.lava_steps is None
                else {
                    name: np.sum([r.lava_steps[name] for r in rows], axis=0).tolist()
                    for name in first.lava_steps
                },
                **mean,
            )
        )
    return out


# The target order on empty hosts: each policy at least as good as the next.
TARGET_ORDER = ("lava", "las", "la_binary", "best_fit")


@dataclass(frozen=True)
class Gap:
    """``ahead`` minus ``behind`` in empty hosts (pp), paired seed by seed."""

    predictor: str
    ahead: str
    behind: str
    by_seed: tuple[float, ...]

    @property
    def mean(self) -> float:
        return float(np.mean(self.by_seed))

    @property
    def seeds_ahead(self) -> int:
        return sum(g > 0 for g in self.by_seed)

    def verdict(self) -> str:
        """holds / fails when the 95 % interval excludes 0 on that side, else not resolved."""
        low, high = self.ci95()
        return "holds" if low > 0 else ("fails" if high < 0 else "not resolved")

    def ci95(self) -> tuple[float, float]:
        """Student's t interval of the mean gap (needs two seeds or more)."""
        from scipy import stats

        n = len(self.by_seed)
        half = stats.t.ppf(0.975, n - 1) * np.std(self.by_seed, ddof=1) / np.sqrt(n)
        return self.mean - float(half), self.mean + float(half)

    def row(self) -> dict[str, Any]:
        low, high = self.ci95()
        return {
            "predictor": self.predictor,
            "ahead": self.ahead,
            "behind": self.behind,
            "gap_pp": round(self.mean, 3),
            "ci95_pp": [round(low, 3), round(high, 3)],
            "seeds_ahead": self.seeds_ahead,
            "seeds": len(self.by_seed),
            "by_seed_pp": [round(g, 3) for g in self.by_seed],
        }


def order_gaps(results: Sequence[SimResult]) -> list[Gap]:
    """For each predictor, the paired per-seed gaps between neighbours of
    ``TARGET_ORDER`` that were both run (rows averaged over two seeds or more)."""
    rows = {(r.policy, r.predictor): r for r in results}
    gaps = []
    for predictor in dict.fromkeys(r.predictor for r in results):
        present = [p for p in TARGET_ORDER if (p, predictor) in rows]
        for ahead, behind in itertools.pairwise(present):
            a = rows[ahead, predictor].empty_hosts_pct_by_seed
            b = rows[behind, predictor].empty_hosts_pct_by_seed
            if a and b and len(a) >= 2:
                diffs = tuple(x - y for x, y in zip(a, b, strict=True))
                gaps.append(Gap(predictor, ahead, behind, diffs))
    return gaps


def render_gaps(gaps: Sequence[Gap]) -> str:
    if not gaps:
        return ""
    lines = [
        f"target order {' >= '.join(TARGET_ORDER)} on empty hosts, paired over "
        f"{len(gaps[0].by_seed)} seeds (pp: mean [95 % CI], seeds where ahead)"
    ]
    for g in gaps:
        low, high = g.ci95()
        lines.append(
            f"  {g.predictor:<7} {g.ahead + ' - ' + g.behind:<22} {g.mean:+6.2f} "
            f"[{low:+6.2f}, {high:+6.2f}]  {g.seeds_ahead}/{len(g.by_seed)}  {g.verdict()}"
        )
    return "\n".join(lines)


def _progress_line(label: str) -> Callable[[float], None]:
    def show(fraction: float) -> None:
        sys.stderr.write(f"\rvm-sim {label:<18} {100 * fraction:5.1f} %")
        sys.stderr.flush()

    return show


# --- outputs -----------------------------------------------------------------------------


def write_outputs(results: Sequence[SimResult], out: Path) -> list[Path]:
    """``vm.json`` (one row per policy x predictor), with two seeds or more
    ``vm_order.json`` (``order_gaps``), and, with matplotlib, ``vm.png``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "vm.json"
    path.write_text(json.dumps([r.row() for r in results], indent=2) + "\n")
    written = [path]
    gaps = order_gaps(results)
    if gaps:
        order = out / "vm_order.json"
        order.write_text(json.dumps([g.row() for g in gaps], indent=2) + "\n")
        written.append(order)
    png = _bar_plot(results, out / "vm.png")
    if png is not None:
        written.append(png)
    return written


def _bar_plot(results: Sequence[SimResult], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    policies = list(dict.fromkeys(r.policy for r in results))
    predictors = list(dict.fromkeys(r.predictor for r in results))
    metrics = (
        ("empty_hosts_pct", "empty hosts %"),
        ("cpu_stranded_pct", "CPU stranded %"),
        ("mem_stranded_pct", "memory stranded %"),
        ("migrations", "migrations"),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.6))
    width = 0.8 / len(predictors)
    x = np.arange(len(policies))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for k, pred in enumerate(predictors):
            values = [
                next((getattr(r, key) for r in results if r.policy == p and r.predictor == pred), 0)
                for p in policies
            ]
            ax.bar(x + k * width - 0.4 + width / 2, values, width, label=pred)
        ax.set_xticks(x, policies, rotation=20)
        ax.set_title(title)
    axes[-1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_table(results: Sequence[SimResult]) -> str:
    lines = [
        f"{'policy':<10} {'predictor':<9} {'empty %':>8} {'ceiling %':>9} {'cpu str %':>9} "
        f"{'mem str %':>9} {'migr':>5} {'rejected':>8} {'wall s':>7}"
    ]
    for r in results:
        lines.append(
            f"{r.policy:<10} {r.predictor:<9} {r.empty_hosts_pct:8.2f} "
            f"{r.empty_ceiling_pct:9.2f} {r.cpu_stranded_pct:9.2f} "
            f"{r.mem_stranded_pct:9.2f} {r.migrations:5d} {r.rejected:8d} {r.wall_s:7.1f}"
            + (f"  by seed {r.empty_hosts_pct_by_seed}" if r.empty_hosts_pct_by_seed else "")
        )
    for r in results:
        if r.labels:
            said_long = r.labels["long_as_long"] + r.labels["short_as_long"]
            long = r.labels["long_as_long"] + r.labels["long_as_short"]
            lines.append(
                f"{r.policy}/{r.predictor} labels: {r.labels['long_as_short']} of {long} long "
                f"VMs said short, {r.labels['short_as_long']} of {said_long} said long are short"
            )
        if r.lava_steps:
            total = max(1, sum(counts[0] for counts in r.lava_steps.values()))
            lines.append(
                f"{r.policy}/{r.predictor} placements by step: share of all (of the "
                "step's: on another host than LAS's pick / extending a host more than it): "
                + ", ".join(
                    f"{name} {100 * n / total:.1f} % ({100 * other / max(n, 1):.0f} / "
                    f"{100 * worse / max(n, 1):.0f} %)"
                    for name, (n, worse, other) in r.lava_steps.items()
                )
            )
    return "\n".join(lines)


# --- CLI ---------------------------------------------------------------------------------


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``vm-sim`` on ``megha-loadgen``'s subcommands."""
    p = subparsers.add_parser(
        "vm-sim",
        help="lifetime-aware VM allocation simulator (best-fit, LA-Binary, LAS, LAVA)",
        description=(
            "Simulate VM allocation for each policy with the learned lifetime model and "
            "with an oracle; report empty hosts, CPU/memory stranding and LARS migrations. "
            "Without --trace it runs on the synthetic trace (loadgen/vm_trace.py)."
        ),
    )
    p.add_argument(
        "--trace",
        type=Path,
        help="VM trace: CSV (format: loadgen/vm_trace.py) or Azure's vmtable.csv[.gz]",
    )
    p.add_argument("--vms", type=positive_int, default=40_000, help="synthetic trace: VMs")
    p.add_argument("--days", type=positive_float, default=10.0, help="synthetic trace: days")
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="synthetic trace and drain RNG seed"
    )
    p.add_argument("--model", type=Path, help="lifetime model (megha predictor train)")
    p.add_argument(
        "--train-vms", type=positive_int, default=10_000, help="without --model: VMs to train on"
    )
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated")
    p.add_argument("--predictors", default=",".join(PREDICTOR_NAMES), help="model,oracle")
    p.add_argument(
        "--hosts", type=non_negative_int, default=0, help="pool size (default: from the trace)"
    )
    p.add_argument("--host-cores", type=positive_int, default=64, help="cores per host")
    p.add_argument("--host-memory-gib", type=positive_int, default=256, help="memory per host, GiB")
    p.add_argument("--warmup-hours", type=non_negative_float, default=48.0)
    p.add_argument("--repredict-minutes", type=positive_float, default=60.0)
    p.add_argument(
        "--maintenance-hours",
        type=non_negative_float,
        default=6.0,
        help="a host starts draining this often (0: no maintenance)",
    )
    p.add_argument("--drain-order", choices=("lars", "random"), default="lars")
    p.add_argument(
        "--extension",
        choices=("distribution", "mean"),
        default="distribution",
        help="LAS/LAVA with the model: expected extension over the predicted distribution "
        "(default) or the extension of the mean",
    )
    p.add_argument(
        "--no-deployments",
        action="store_true",
        help="synthetic trace: independent VMs instead of deployments that live alike",
    )
    p.add_argument(
        "--seeds",
        type=positive_int,
        default=1,
        help="synthetic trace: run seeds SEED..SEED+N-1 and report the mean of each row",
    )
    p.add_argument(
        "--jobs",
        type=non_negative_int,
        default=0,
        help="with --seeds: seeds run in parallel processes (default: one per core)",
    )
    p.add_argument("--out", type=Path, help="write vm.json and vm.png here")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    return p


def main(args: argparse.Namespace) -> int:
    """Run ``vm-sim`` from parsed arguments; 0 on success, 2 on bad input."""
    policies = [p for p in args.policies.split(",") if p]
    predictors = [p for p in args.predictors.split(",") if p]
    bad = [p for p in policies if p not in POLICY_NAMES] + [
        p for p in predictors if p not in PREDICTOR_NAMES
    ]
    if bad:
        print(f"megha-loadgen: unknown policy or predictor {', '.join(bad)}", file=sys.stderr)
        return 2
    need_model = "model" in predictors
    try:
        trace, model = _inputs(args, need_model)
    except (OSError, ValueError, ModelError) as err:
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2
    span_h = float(trace.arrival_s.max()) / HOUR_S if len(trace.arrival_s) else 0.0
    if span_h < args.warmup_hours:
        print(
            f"megha-loadgen: warning: the trace spans {span_h:.1f} h, less than the "
            f"{args.warmup_hours:g} h warm-up (--warmup-hours): each row is one sample, "
            "taken at the trace's end",
            file=sys.stderr,
        )
    if args.seeds > 1 and (args.trace or args.model):
        print("megha-loadgen: --seeds N > 1 needs the synthetic trace", file=sys.stderr)
        return 2
    seeds = range(args.seed, args.seed + args.seeds)
    jobs = min(args.jobs or os.cpu_count() or 1, len(seeds))
    progress = sys.stderr.isatty()
    if jobs == 1:
        runs = [_run_seed(args, seeds[0], policies, predictors, progress, (trace, model))]
        runs += [_run_seed(args, seed, policies, predictors, progress) for seed in seeds[1:]]
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            # The other seeds in ``jobs`` child processes; meanwhile the first here, on the
            # inputs already built (one process more than ``jobs`` until it ends).
            others = [
                pool.submit(_run_seed, args, seed, policies, predictors, False)
                for seed in seeds[1:]
            ]
            runs = [_run_seed(args, seeds[0], policies, predictors, progress, (trace, model))]
            for seed, future in zip(seeds[1:], others, strict=True):
                runs.append(future.result())
                if progress:
                    sys.stderr.write(f"vm-sim: seed {seed} done\n")
    results = runs[0] if len(runs) == 1 else average_runs(runs)
    if args.json:
        print(json.dumps([r.row() for r in results], indent=2))
    else:
        print(render_table(results))
        if gaps := render_gaps(order_gaps(results)):
            print(gaps)
    if args.out:
        for path in write_outputs(results, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _run_seed(
    args: argparse.Namespace,
    seed: int,
    policies: Sequence[str],
    predictors: Sequence[str],
    progress: bool,
    inputs: tuple[VmTrace, Any] | None = None,
) -> list[SimResult]:
    """Every policy x predictor on one seed's trace (built here unless given)."""
    if inputs is None:
        inputs = _inputs(argparse.Namespace(**{**vars(args), "seed": seed}), "model" in predictors)
    trace, model = inputs
    options = SimOptions(
        host_cpu_milli=args.host_cores * 1000,
        host_memory_mb=args.host_memory_gib * 1024,
        hosts=args.hosts,
        warmup_s=args.warmup_hours * HOUR_S,
        repredict_s=args.repredict_minutes * 60.0,
        maintenance_interval_s=args.maintenance_hours * HOUR_S,
        drain_order=args.drain_order,
        extension=args.extension,
        seed=seed,
    )
    return run_all(trace, model, options, policies, predictors, progress)


def _report_skipped(path: Path, stats: ReadStats) -> None:
    if stats.skipped:
        print(
            f"megha-loadgen: {path}: skipped {stats.skipped} malformed rows, e.g. "
            + "; ".join(stats.problems[:3]),
            file=sys.stderr,
        )


def _inputs(args: argparse.Namespace, need_model: bool) -> tuple[VmTrace, Any]:
    from services.predictor.lifetime_model import load_model, train_lifetime_model

    if args.trace:
        stats = ReadStats()
        trace = read_vm_trace(args.trace, stats)
        _report_skipped(args.trace, stats)
        train = None
        if need_model and not args.model:
            # Train on the first 30 % of the span, simulate the rest.
            cut = trace.arrival_s.min() + 0.3 * np.ptp(trace.arrival_s)
            train = trace.subset(np.flatnonzero(trace.arrival_s < cut))
            trace = trace.subset(np.flatnonzero(trace.arrival_s >= cut))
            trace.arrival_s = trace.arrival_s - cut
    else:
        deployments = not args.no_deployments
        trace = synthetic_vm_trace(
            vms=args.vms, days=args.days, seed=args.seed, deployments=deployments
        )
        train = None
        if need_model and not args.model:
            # Another sample (seed) of the same user population.
            train = synthetic_vm_trace(
                vms=args.train_vms,
                days=args.days,
                seed=args.seed + 1_000,
                prehistory_days=0,
                deployments=deployments,
            )
    if not need_model:
        return trace, None
    if args.model:
        return trace, load_model(args.model)
    assert train is not None
    if sys.stderr.isatty():
        sys.stderr.write(f"vm-sim: training the lifetime model on {len(train)} VMs...\n")
    # The policies use only E[remaining]: the quantile models would cost 3x the time.
    return trace, train_lifetime_model(train.features, train.lifetime_s, quantile_levels=())
