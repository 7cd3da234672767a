"""GPA, the Gaussian Percentile Approximation (Janus & Rzadca, SoCC'17): a probabilistic
CPU fit test that lets a node hold more than its capacity's worth of CPU *requests* as long
as the chance that its tasks' *usage* exceeds capacity stays below an SLO rho.

A node's total CPU usage is approximated by N(M, V), with M and V the sums of its running
tasks' usage means and variances. Task k fits iff

    Phi((c - (mu_k + M)) / sqrt(sigma_k^2 + V)) >= 1 - rho

which is the same as ``c - (mu_k + M) >= z_rho * sqrt(sigma_k^2 + V)`` with
``z_rho = Phi^-1(1 - rho)``: a comparison against a constant, O(1) per node given the
running sums, and vectorised over every candidate node (no CDF on the hot path).

    TaskSpec ──task_usage──> (mu, sigma^2)          NodeTable.usage_mean / usage_var
                                  │                  (ClusterState keeps the running sums)
                                  ▼                               │
                  GpaPolicy.select / fits ◀───────────────────────┘
                  cpu: GPA test; memory, disk, net: strict (free >= request)

The second half of the module is the offline side used by ``megha-loadgen gpa-eval``:
the paper's bin packers (First Fit, Best Fit, then its rebalancing) over a ``FitRule``,
which expresses GPA and the baselines (``av``, ``perc``, Cantelli) as one kind of test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Any

import numpy as np
from bitarray import bitarray

from services.core.node_table import NodeTable, bools_from_bits
from services.core.resources import CPU, MAX_VALUE, format_resources
from services.core.task import TaskSpec

# scipy's ndtr is exact in the far tail; the fallback is a ufunc over math.erfc. Imported
# on first use: scipy.special costs a quarter of a second, and most runs never ask.
_UNLOADED: Any = object()
_ndtr: Any = _UNLOADED

NO_NODE = -1  # the same "no node" as services.core.match.NO_NODE (match imports us)
DEFAULT_RHO = 0.01
# A task's std is capped so that its variance (millicores^2) stays an exact float64
# integer and a node's sum of thousands of them stays far below 2**53.
_MAX_STD = float(1 << 24)
_erfc = np.frompyfunc(math.erfc, 1, 1)


# ------------------------------------------------------------------ the fit test
def normal_sf(x: np.ndarray) -> np.ndarray:
    """P(Z > x) for a standard normal Z, element-wise (accurate far into the tail)."""
    global _ndtr
    x = np.asarray(x, dtype=np.float64)
    if _ndtr is _UNLOADED:
        try:
            from scipy.special import ndtr as _ndtr
        except ImportError:  # pragma: no cover - exercised by a test that forces the fallback
            _ndtr = None
    if _ndtr is not None:
        return _ndtr(-x)
    return (0.5 * _erfc(x / math.sqrt(2.0))).astype(np.float64)


@lru_cache(maxsize=64)
def gpa_z(rho: float) -> float:
    """The z with P(Z > z) = rho: the test's threshold in standard deviations."""
    if not 0.0 < rho < 1.0:
        raise ValueError(f"GPA's SLO rho must be in (0, 1), got {rho}")
    return -NormalDist().inv_cdf(rho)  # inv_cdf(rho), not (1 - rho): exact for tiny rho


def overflow_probability(
    capacity_milli: np.ndarray,
    sum_mean_milli: np.ndarray,
    sum_var_milli2: np.ndarray,
    task_mean_milli: float,
    task_std_milli: float,
) -> np.ndarray:
    """P(usage > capacity) per node once the task joins, under the Gaussian approximation.

    A node with zero total variance is deterministic: 1 if the means exceed capacity,
    else 0 (usage exactly at capacity is not an overflow).
    """
    cap = np.asarray(capacity_milli, dtype=np.float64)
    mean = np.asarray(sum_mean_milli, dtype=np.float64) + task_mean_milli
    var = np.maximum(np.asarray(sum_var_milli2, dtype=np.float64) + task_std_milli**2, 0.0)
    std = np.sqrt(var)
    headroom = cap - mean
    random_part = normal_sf(np.divide(headroom, std, out=np.zeros_like(std), where=std > 0))
    return np.where(std > 0, random_part, (headroom < 0).astype(np.float64))


def fits_gpa(
    capacity_milli: np.ndarray,
    sum_mean_milli: np.ndarray,
    sum_var_milli2: np.ndarray,
    task_mean_milli: float,
    task_std_milli: float,
    rho: float,
) -> np.ndarray:
    """Per node: does the task fit, i.e. ``overflow_probability <= rho``?

    Computed as ``c - mean >= z_rho * std`` (equivalent, no CDF); a result can differ from
    comparing ``overflow_probability`` with rho only when the two are within rounding.
    """
    return _gpa_ok(
        np.asarray(capacity_milli, dtype=np.float64),
        np.asarray(sum_mean_milli, dtype=np.float64),
        np.asarray(sum_var_milli2, dtype=np.float64),
        float(task_mean_milli),
        float(task_std_milli) ** 2,
        gpa_z(rho),
    )


def _gpa_ok(
    cap: np.ndarray, mean: np.ndarray, var: np.ndarray, task_mean: float, task_var: float, z: float
) -> np.ndarray:
    # max(.., 0): a variance sum can't be negative, but a hand-edited view might say so.
    return cap - (mean + task_mean) >= z * np.sqrt(np.maximum(var + task_var, 0.0))


def task_usage(task: TaskSpec) -> tuple[float, float]:
    """The (mean, variance) of the task's CPU usage that GPA books, in millicores.

    A task without an estimate (mean and std both 0, or not finite) counts its whole CPU
    request as its mean with no variance: GPA then treats it exactly like strict fit does.
    Values are rounded to whole millicores (and millicores^2) so the running sums in
    ``NodeTable`` are float64 integers: adding and removing millions of tasks is exact,
    and an emptied node is back at exactly 0.
    """
    mean, std = task.cpu_usage_mean, task.cpu_usage_std
    mean = mean if math.isfinite(mean) and mean > 0 else 0.0
    std = std if math.isfinite(std) and std > 0 else 0.0
    if mean == 0.0 and std == 0.0:
        return float(task.resources[CPU]), 0.0
    std = min(std, _MAX_STD)
    return float(round(min(mean, MAX_VALUE))), float(round(std * std))


# ------------------------------------------------------------------ the policy
class GpaPolicy:
    """GPA for CPU, strict for everything else; the GM's ``select`` and the LM's ``fits``.

    Assumptions:
    - tasks' CPU usages on a node are independent, and their sum is close to Gaussian
      (the paper finds this holds for the high percentiles of sums of >= ~10 tasks, even
      though single tasks follow no common distribution);
    - ``NodeTable.usage_mean`` / ``usage_var`` hold the sums over the node's running tasks
      (``ClusterState`` keeps them; GMs get them with the free columns);
    - memory, disk and network are never oversubscribed, and no task may request more CPU
      than the node has, so a node's *free* CPU (capacity minus requests) may go negative
      but its usage overflows with probability at most rho when the model holds.

    Algorithm (``select``), first fit as in ``FirstFit``:
    1. find the first candidate bit; take a window of rows starting there;
    2. one numpy comparison per strict resource, one for the CPU request against capacity
       and one for the GPA test ``c - (M + mu) >= z_rho * sqrt(V + sigma^2)``;
    3. the first row passing all wins; else jump past the window and grow it 4x.
    """

    name = "gpa"
    strict_cpu = False  # may place where free CPU is short (the GPA test judges CPU)
    first_window = 256

    def __init__(self, rho: float = DEFAULT_RHO):
        self.z = gpa_z(rho)  # validates rho
        self.rho = rho

    def _rows_ok(
        self,
        table: NodeTable,
        rows: slice | int,
        task: TaskSpec,
        extra_free: np.ndarray | None = None,
        extra_usage: tuple[float, float] | None = None,
    ) -> np.ndarray:
        request = task.resources
        mean, var = task_usage(task)
        usage_mean, usage_var = table.usage_mean[rows], table.usage_var[rows]
        if extra_usage is not None:
            usage_mean, usage_var = usage_mean - extra_usage[0], usage_var - extra_usage[1]
        ok = _gpa_ok(table.capacity[CPU, rows], usage_mean, usage_var, mean, var, self.z)
        ok &= table.capacity[CPU, rows] >= request[CPU]
        free = table.free
        for d in np.flatnonzero(request).tolist():
            if d != CPU:
                have = free[d, rows] if extra_free is None else free[d, rows] + extra_free[d]
                ok &= have >= request[d]
        return ok

    def select(self, table: NodeTable, cand: bitarray, task: TaskSpec) -> int:
        n = len(cand)
        pos = cand.find(1)
        window = self.first_window
        while pos >= 0:
            start = pos & ~7  # byte-aligned slices of a bitarray are cheap to unpack
            stop = min(n, start + window)
            ok = bools_from_bits(cand, start, stop) & self._rows_ok(table, slice(start, stop), task)
            hit = int(ok.argmax())
            if ok[hit]:
                return start + hit
            if stop >= n:
                break
            pos = cand.find(1, stop)
            window *= 4
        return NO_NODE

    def fits(
        self,
        table: NodeTable,
        node: int,
        task: TaskSpec,
        extra_free: np.ndarray | None = None,
        extra_usage: tuple[float, float] | None = None,
    ) -> bool:
        """Would ``task`` fit on ``node``, once ``extra_free`` resources and ``extra_usage``
        (mean, variance) of preemption victims are gone?"""
        return bool(self._rows_ok(table, node, task, extra_free, extra_usage))

    def explain(
        self,
        table: NodeTable,
        node: int,
        task: TaskSpec,
        extra_free: np.ndarray | None = None,
        extra_usage: tuple[float, float] | None = None,
    ) -> str:
        """Why ``fits`` says no, in the words of the test that failed."""
        node_id = table.node_ids[node]
        request = task.resources
        free = table.free[:, node] + (0 if extra_free is None else extra_free)
        short = free < request
        short[CPU] = False  # cpu is judged by the GPA test below, not by free
        if short.any():
            shown = free.copy()
            shown[CPU] = max(int(shown[CPU]), 0)
            return (
                f"node {node_id} has {format_resources(shown)} free (cpu by GPA), "
                f"task needs {format_resources(request)}"
            )
        cap = int(table.capacity[CPU, node])
        if request[CPU] > cap:
            return f"node {node_id} has {cap}m cpu in all, task requests {int(request[CPU])}m"
        mean, var = task_usage(task)
        node_mean, node_var = float(table.usage_mean[node]), float(table.usage_var[node])
        if extra_usage is not None:
            node_mean, node_var = node_mean - extra_usage[0], node_var - extra_usage[1]
        p = float(overflow_probability(cap, node_mean, max(node_var, 0.0), mean, math.sqrt(var)))
        return (
            f"node {node_id}: P(cpu usage > {cap}m) would be {p:.3g} > rho {self.rho:g} "
            f"(usage mean {node_mean + mean:.0f}m, std {math.sqrt(max(node_var + var, 0)):.0f}m)"
        )


# -------------------------------------------------------------- offline packing
@dataclass(frozen=True, slots=True, eq=False)
class FitRule:
    """A fit test over running sums: a bin's load is ``sum(sizes) + k * sqrt(sum(variances))``
    and an item fits while the load stays <= capacity. The paper's methods are all of
    this form, so one packer serves them all:

    - GPA rho: size = mean usage, variance = usage variance, k = z_rho;
    - Cantelli b: the same with k = b (a distribution-free bound: P <= 1 / (1 + b^2));
    - ``av`` f: size = f x mean usage, k = 0;
    - ``perc`` p: size = the p-th percentile of usage, k = 0.
    """

    sizes: np.ndarray  # float64 (n,)
    variances: np.ndarray  # float64 (n,)
    k: float = 0.0

    @classmethod
    def gpa(cls, mean: np.ndarray, std: np.ndarray, rho: float) -> FitRule:
        return cls(np.asarray(mean, np.float64), np.asarray(std, np.float64) ** 2, gpa_z(rho))

    @classmethod
    def cantelli(cls, mean: np.ndarray, std: np.ndarray, b: float) -> FitRule:
        return cls(np.asarray(mean, np.float64), np.asarray(std, np.float64) ** 2, float(b))

    @classmethod
    def average(cls, mean: np.ndarray, f: float) -> FitRule:
        sizes = f * np.asarray(mean, np.float64)
        return cls(sizes, np.zeros_like(sizes))

    @classmethod
    def percentile(cls, values: np.ndarray) -> FitRule:
        sizes = np.asarray(values, np.float64)
        return cls(sizes, np.zeros_like(sizes))

    def loads(self, size_sums: np.ndarray, var_sums: np.ndarray) -> np.ndarray:
        if self.k == 0.0:
            return size_sums
        return size_sums + self.k * np.sqrt(np.maximum(var_sums, 0.0))


def pack(
    rule: FitRule,
    capacity: float,
    packer: str = "first-fit",
    rebalance: bool = True,
    max_failures: int = 5,
) -> np.ndarray:
    """Bin (machine) index per item, items taken in order; bins are numbered 0..m-1.

    ``first-fit`` puts an item into the lowest-numbered bin it fits in, ``best-fit`` into
    the one left with the least room (highest load); an item fitting nowhere opens a new
    bin, even if it overflows an empty one on its own. Each step is one vector operation
    over the open bins. ``rebalance`` then applies the paper's rebalancing.
    """
    if packer not in ("first-fit", "best-fit"):
        raise ValueError(f"unknown packer {packer!r}; use first-fit or best-fit")
    n = len(rule.sizes)
    size_sums, var_sums = np.zeros(n), np.zeros(n)
    bins = np.empty(n, dtype=np.int64)
    open_bins = 0
    best = packer == "best-fit"
    for i, (size, var) in enumerate(zip(rule.sizes.tolist(), rule.variances.tolist(), strict=True)):
        j = open_bins
        if open_bins:
            load = rule.loads(size_sums[:open_bins] + size, var_sums[:open_bins] + var)
            ok = load <= capacity
            # best fit: the fullest bin it fits in; first fit: the first one
            choice = int((np.where(ok, load, -np.inf) if best else ok).argmax())
            if ok[choice]:
                j = choice
        if j == open_bins:
            open_bins += 1
        bins[i] = j
        size_sums[j] += size
        var_sums[j] += var
    if rebalance:
        bins = rebalance_last_bin(rule, capacity, bins, max_failures)
    return bins


def rebalance_last_bin(
    rule: FitRule, capacity: float, bins: np.ndarray, max_failures: int = 5
) -> np.ndarray:
    """The paper's rebalancing: a packer leaves its last bin nearly empty and the others
    full, so move items to the last bin, taking from the other bins round-robin.

    Each turn offers the most recently placed item of the next bin (never a bin's only
    item, so the machine count stays). It moves if the last bin still passes the fit test
    and is then no more loaded than the source was (so the load evens out instead of
    piling up on the last bin). ``max_failures`` consecutive refusals end it. Returns a new
    assignment.
    """
    bins = bins.copy()
    m = int(bins.max()) + 1 if bins.size else 0
    if m < 2:
        return bins
    last = m - 1
    stacks: list[list[int]] = [[] for _ in range(m)]
    for item, b in enumerate(bins.tolist()):
        stacks[b].append(item)
    size_sums = np.bincount(bins, weights=rule.sizes, minlength=m)
    var_sums = np.bincount(bins, weights=rule.variances, minlength=m)
    failures, source = 0, 0
    while failures < max_failures:
        stack = stacks[source]
        failures += 1
        if len(stack) > 1:
            item = stack[-1]
            size, var = float(rule.sizes[item]), float(rule.variances[item])
            after = float(rule.loads(size_sums[last] + size, var_sums[last] + var))
            before = float(rule.loads(size_sums[source], var_sums[source]))
            if after <= capacity and after <= before:
                stack.pop()
                bins[item] = last
                size_sums[[last, source]] += (size, -size)
                var_sums[[last, source]] += (var, -var)
                failures = 0
        source = (source + 1) % last
    return bins
