"""Augment trace jobs with what the traces lack: placement constraints, network demand,
and prototype-sized resources.

Pure functions over lists of ``TraceJob``: they return new jobs and never touch the
input. Randomness comes only from the ``numpy.random.Generator`` passed in, so one seed
gives one output.

- ``sharma_constraints``: 21 placement constraints after Sharma et al., "Modeling and
  synthesizing task placement constraints in Google compute clusters" (SoCC'11), the way
  the Megha paper synthesises them; ``machine_constraints`` draws the matching machines.
- ``gridiron_bandwidth``: per-task ``net_mbps`` from Gridiron's compute-derived VDC model.
- ``scale_resources`` / ``cores_per_task``: shrink requests for a prototype (the paper
  divides CPU by 400 and memory by 50) or give every task the same CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from loadgen.trace import TraceJob, TraceTask
from services.core.constraints import from_mask

NUM_CONSTRAINTS = 21
CLUSTERS = ("A", "B", "C")
DEFAULT_MACHINES = 10_000  # the paper's 10k-worker runs


def _table(text: str) -> np.ndarray:
    """A whitespace-separated table of numbers, one row a line."""
    return np.array([[float(x) for x in line.split()] for line in text.strip().splitlines()])


# ---------------------------------------------------------------------------------------
# Task constraint frequencies. Source: the Megha authors' constraint-aware simulator
# (github.com/meghanat/megha-constraint-aware, megha3.0/src/megha_sim/simulation/
# simulation.py: ``tcfv`` and ``task_occurrence``; task/task_constraints.py samples them).
# A task draws a task type uniformly from 4, then one of 10 statistical clusters with the
# type's weights below, then requires each constraint c independently with probability
# TASK_CONSTRAINT_PERCENT[cluster, c] / 100. These are the numbers that simulator uses;
# we could not check them against the tables of Sharma et al. themselves (the paper's
# text was not available to us), so treat them as "Megha's synthesis", not as the paper's.
TASK_CONSTRAINT_PERCENT = _table(
    """
    8   7   7   10   23   20   30   1   3   1   4   3   2   1   4   2   9   8   11   25   29
    7.5 6.6 6.6 9.4  21.6 18.8 28.2 0.9 2.8 0.9 3.8 2.8 1.9 0.9 3.8 1.9 8.5 7.5 10.3 23.5 27.3
    7.8 6.9 6.9 9.8  22.5 19.6 29.4 1   2.9 1   3.9 2.9 2   1   3.9 2   8.8 7.8 10.8 24.5 28.4
    5.8 5   5   7.2  16.6 14.4 21.6 0.7 2.2 0.7 2.9 2.2 1.4 0.7 2.9 1.4 6.5 5.8 7.9  18   20.9
    9.7 8.5 8.5 12.1 27.8 24.2 36.3 1.2 3.6 1.2 4.8 3.6 2.4 1.2 4.8 2.4 10.9 9.7 13.3 30.2 35.1
    6.6 5.7 5.7 8.2  18.9 16.4 24.6 0.8 2.5 0.8 3.3 2.5 1.6 0.8 3.3 1.6 7.4 6.6 9    20.5 23.8
    8.7 7.6 7.6 10.9 25.1 21.8 32.7 1.1 3.3 1.1 4.4 3.3 2.2 1.1 4.4 2.2 9.8 8.7 12   27.3 31.6
    4.7 4.1 4.1 5.9  13.6 11.8 17.7 0.6 1.8 0.6 2.4 1.8 1.2 0.6 2.4 1.2 5.3 4.7 6.5  14.8 17.1
    5.7 5   5   7.1  16.3 14.2 21.3 0.7 2.1 0.7 2.8 2.1 1.4 0.7 2.8 1.4 6.4 5.7 7.8  17.8 20.6
    7.2 6.3 6.3 9    20.6 17.9 26.9 0.9 2.7 0.9 3.6 2.7 1.8 0.9 3.6 1.8 8.1 7.2 9.9  22.4 26
    """
)
# Row = statistical cluster 1..10, column = task type 1..4 (normalised per column).
STATISTICAL_CLUSTER_WEIGHTS = _table(
    """
    0.039628712871287115 0.12043316831683168  0.13037128712871288  0.11675742574257425
    0.1404950495049505   0.07971534653465345  0.16081683168316832  0.12047029702970297
    0.05905940594059404  0.11016089108910891  0.1506683168316832   0.13383663366336634
    0.12032178217821782  0.12043316831683168  0.049306930693069295 0.09658415841584157
    0.08987623762376236  0.09976485148514852  0.16081683168316832  0.11675742574257425
    0.11004950495049505  0.09976485148514852  0.12047029702970297  0.1101980198019802
    0.08987623762376236  0.059294554455445535 0.028886138613861374 0.049306930693069295
    0.1404950495049505   0.13033415841584156  0.049306930693069295 0.10388613861386138
    0.12032178217821782  0.09011138613861384  0.12047029702970297  0.09980198019801981
    0.08987623762376236  0.08998762376237622  0.028886138613861374 0.052400990099009885
    """
)

# ---------------------------------------------------------------------------------------
# Machine constraint probabilities: the share of machines that satisfy each constraint.
# APPROXIMATIONS, not Sharma et al.'s numbers (we could not obtain the paper's tables):
# - "C" is measured from the machines the Megha authors' simulator uses: the bit vectors
#   of the first partition (400 machines) of megha3.0/simulator_config/
#   megha_config_G5L5S10000_C.json, counted per constraint (standard error <= 2.5
#   points). The bits look independent across constraints (no pairwise |r| > 0.2), so we
#   draw them independently too. Whether that file's "_C" means Sharma's cluster C is not
#   stated there.
# - "A" and "B" are synthetic variants of "C" that keep its shape: A = p ** 0.5 is a more
#   homogeneous cluster (more machines satisfy each constraint), B = p ** 1.5 a more
#   heterogeneous one (constraints bite harder), standing in for the paper's finding that
#   the clusters differ in how much constraints restrict placement.
_MEASURED = _table(  # constraint c is at row c // 7, column c % 7
    """
    0.390 0.638 0.172 0.425 0.662 0.112 0.285
    0.170 0.705 0.728 0.448 0.458 0.315 0.090
    0.720 0.162 0.535 0.302 0.685 0.692 1.000
    """
).ravel()
MACHINE_PROBABILITIES: dict[str, np.ndarray] = {
    "A": np.sqrt(_MEASURED),
    "B": _MEASURED**1.5,
    "C": _MEASURED,
}
RESAMPLES = 20  # redraws of an unsatisfiable constraint set before trimming it
_BIT_VALUES = np.uint64(1) << np.arange(NUM_CONSTRAINTS, dtype=np.uint64)


@dataclass
class ConstraintReport:
    """What ``sharma_constraints`` had to do so every task can be placed somewhere."""

    tasks: int = 0
    machines: int = 0  # how many machines the sets were checked against
    unsatisfiable: int = 0  # first draws no machine satisfied
    redrawn: int = 0  # of those, fixed by drawing again (rejection sampling)
    trimmed: int = 0  # still unsatisfiable after RESAMPLES draws: rarest constraints dropped

    def render(self) -> str:
        return (
            f"constraints: {self.tasks} tasks against {self.machines} machines; "
            f"{self.unsatisfiable} first draws unsatisfiable ({self.redrawn} redrawn, "
            f"{self.trimmed} trimmed)"
        )


def task_constraint_frequencies() -> np.ndarray:
    """The expected share of tasks requiring each constraint under the table above."""
    weights = STATISTICAL_CLUSTER_WEIGHTS / STATISTICAL_CLUSTER_WEIGHTS.sum(axis=0)
    per_type = weights.T @ (TASK_CONSTRAINT_PERCENT / 100)  # task type x constraint
    return per_type.mean(axis=0)


def sample_task_masks(count: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``count`` constraint sets (as uint64 masks) from the task table."""
    weights = STATISTICAL_CLUSTER_WEIGHTS / STATISTICAL_CLUSTER_WEIGHTS.sum(axis=0)
    cumulative = np.cumsum(weights, axis=0)  # cluster x type
    types = rng.integers(0, weights.shape[1], size=count)
    u = rng.random(count)
    cluster = (u[:, None] > cumulative[:, types].T).sum(axis=1)
    cluster = np.minimum(cluster, weights.shape[0] - 1)  # guards float round-off at 1.0
    bits = rng.random((count, NUM_CONSTRAINTS)) < TASK_CONSTRAINT_PERCENT[cluster] / 100
    return _to_masks(bits)


def machine_constraints(num_machines: int, cluster: str, rng: np.random.Generator) -> np.ndarray:
    """Constraint masks (uint64, bit c = satisfies constraint c) for ``num_machines``
    machines of Sharma cluster ``cluster`` (see MACHINE_PROBABILITIES)."""
    probabilities = _probabilities(cluster)
    if num_machines < 0:
        raise ValueError(f"num_machines must be >= 0, got {num_machines}")
    return _to_masks(rng.random((num_machines, NUM_CONSTRAINTS)) < probabilities)


def satisfiable(task_masks: np.ndarray, machine_masks: np.ndarray) -> np.ndarray:
    """For each task mask, whether some machine satisfies every constraint in it."""
    task_masks = np.asarray(task_masks, dtype=np.uint64)
    machines = np.unique(np.asarray(machine_masks, dtype=np.uint64))
    unique, inverse = np.unique(task_masks, return_inverse=True)
    ok = np.array([bool(np.any((machines & m) == m)) for m in unique], dtype=bool)
    return ok[inverse.reshape(-1)] if len(unique) else np.zeros(len(task_masks), dtype=bool)


def sharma_constraints(
    jobs: Iterable[TraceJob],
    cluster: str,
    rng: np.random.Generator,
    *,
    machines: np.ndarray | None = None,
    report: ConstraintReport | None = None,
) -> list[TraceJob]:
    """Give every task a constraint set drawn from the task table (replacing any it had).

    Every set is made satisfiable by at least one of ``machines`` (default: a fresh
    ``DEFAULT_MACHINES``-machine cluster drawn from ``cluster`` with ``rng``; pass the
    masks your simulated workers carry to match them exactly). A set no machine
    satisfies is drawn again, up to RESAMPLES times, which samples the table conditioned
    on being placeable; one still unsatisfiable then loses its rarest constraints until
    it fits. ``report`` counts both, so a run can say how far it departs from the table.
    """
    jobs = list(jobs)
    if machines is None:
        machines = machine_constraints(DEFAULT_MACHINES, cluster, rng)
    machines = np.asarray(machines, dtype=np.uint64)
    if len(machines) == 0:
        raise ValueError("no machines to satisfy constraints against")
    report = report if report is not None else ConstraintReport()
    count = sum(len(j.tasks) for j in jobs)
    masks = sample_task_masks(count, rng)
    ok = satisfiable(masks, machines)
    report.tasks, report.machines = report.tasks + count, len(machines)
    report.unsatisfiable += int((~ok).sum())
    for _ in range(RESAMPLES):
        bad = np.flatnonzero(~ok)
        if len(bad) == 0:
            break
        masks[bad] = sample_task_masks(len(bad), rng)
        ok[bad] = satisfiable(masks[bad], machines)
        report.redrawn += int(ok[bad].sum())
    for i in np.flatnonzero(~ok):
        masks[i] = _trim(int(masks[i]), machines, _probabilities(cluster))
        report.trimmed += 1
    return _with_constraints(jobs, masks)


def _trim(mask: int, machines: np.ndarray, probabilities: np.ndarray) -> int:
    """Drop the constraint fewest machines satisfy until some machine satisfies the rest."""
    rarest_first = sorted(from_mask(mask), key=lambda c: probabilities[c])
    for c in rarest_first:
        if np.any((machines & np.uint64(mask)) == np.uint64(mask)):
            break
        mask &= ~(1 << c)
    return mask


def _with_constraints(jobs: list[TraceJob], masks: np.ndarray) -> list[TraceJob]:
    cache: dict[int, tuple[int, ...]] = {}
    out, position = [], 0
    for job in jobs:
        tasks = []
        for task in job.tasks:
            mask = int(masks[position])
            position += 1
            if mask not in cache:
                cache[mask] = tuple(from_mask(mask))
            tasks.append(replace(task, constraints=cache[mask]))
        out.append(replace(job, tasks=tuple(tasks)))
    return out


def _to_masks(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint64) * _BIT_VALUES).sum(axis=1, dtype=np.uint64)


def _probabilities(cluster: str) -> np.ndarray:
    if cluster not in MACHINE_PROBABILITIES:
        raise ValueError(f"unknown Sharma cluster {cluster!r}; known: {', '.join(CLUSTERS)}")
    return MACHINE_PROBABILITIES[cluster]


# ---------------------------------------------------------------------------------------
# Gridiron: network demand derived from compute (Amdahl's second law).


def vlink_cap_mbps(peak_vdc: int = 30, uplink_mbps: float = 40_000) -> int:
    """Gridiron's datacenter-aware vlink cap ``B <= 4C / P**2``, in whole Mbit/s.

    A server hosting D of a VDC's P members carries D * (P - D) vlinks over its uplink C,
    so ``B * D * (P - D) <= C``; the worst case D = P/2 gives ``4C / P**2``. Rounded down
    so the inequality still holds (P=30, C=40,000 -> 177).
    """
    if peak_vdc < 2 or uplink_mbps <= 0:
        raise ValueError("peak_vdc must be >= 2 and uplink_mbps > 0")
    return math.floor(4 * uplink_mbps / peak_vdc**2)


def vdc_sizes(num_tasks: int, peak_vdc: int = 30) -> list[int]:
    """Split a job of ``num_tasks`` into VDCs by rolling overflow: the first ``peak_vdc``
    tasks form one VDC, the overflow rolls into the next, and so on."""
    if peak_vdc < 1:
        raise ValueError("peak_vdc must be >= 1")
    full, rest = divmod(num_tasks, peak_vdc)
    return [peak_vdc] * full + ([rest] if rest else [])


def gridiron_bandwidth(
    jobs: Iterable[TraceJob],
    bpc_mbps_per_core: float,
    peak_vdc: int = 30,
    uplink_mbps: float = 40_000,
) -> list[TraceJob]:
    """Set each task's ``net_mbps`` from its VDC (a job, split into VDCs of at most
    ``peak_vdc`` tasks in task order).

    Within a VDC every pair of tasks is joined by a vlink of ``bpc x min(cores_a,
    cores_b)`` Mbit/s, capped at ``vlink_cap_mbps(peak_vdc, uplink_mbps)``. A task's
    ``net_mbps`` is the sum of its vlinks to the other members, rounded up: the worst case
    its NIC must carry when none of them shares its machine (Gridiron sizes the same
    all-to-all graph against the server uplink). A VDC of one task needs no network.
    """
    if bpc_mbps_per_core < 0:
        raise ValueError("bpc_mbps_per_core must be >= 0")
    cap = vlink_cap_mbps(peak_vdc, uplink_mbps)
    out = []
    for job in jobs:
        tasks: list[TraceTask] = []
        for size in vdc_sizes(len(job.tasks), peak_vdc):
            members = job.tasks[len(tasks) : len(tasks) + size]
            cores = np.array([t.cpu_milli for t in members], dtype=float) / 1000
            links = np.minimum(bpc_mbps_per_core * np.minimum.outer(cores, cores), cap)
            np.fill_diagonal(links, 0.0)
            demand = np.ceil(links.sum(axis=1) - 1e-9).astype(int)
            tasks.extend(replace(t, net_mbps=int(d)) for t, d in zip(members, demand, strict=True))
        out.append(replace(job, tasks=tuple(tasks)))
    return out


# ---------------------------------------------------------------------------------------
# Resource scaling for prototypes.


def scale_resources(
    jobs: Iterable[TraceJob], cpu_divisor: float = 400, mem_divisor: float = 50
) -> list[TraceJob]:
    """Divide every task's CPU and memory request, rounding up so a non-zero request never
    becomes 0 (the Megha prototype divides CPU by 400 and memory by 50)."""
    if cpu_divisor <= 0 or mem_divisor <= 0:
        raise ValueError("divisors must be > 0")

    def shrink(value: int, divisor: float) -> int:
        return math.ceil(value / divisor) if value > 0 else value

    return [
        replace(
            job,
            tasks=tuple(
                replace(
                    t,
                    cpu_milli=shrink(t.cpu_milli, cpu_divisor),
                    memory_mb=shrink(t.memory_mb, mem_divisor),
                )
                for t in job.tasks
            ),
        )
        for job in jobs
    ]


def cores_per_task(jobs: Iterable[TraceJob], cpu_milli: int) -> list[TraceJob]:
    """Give every task the same CPU request (``.tr`` traces carry none)."""
    if cpu_milli <= 0:
        raise ValueError(f"cpu_milli must be > 0, got {cpu_milli}")
    return [
        replace(job, tasks=tuple(replace(t, cpu_milli=cpu_milli) for t in job.tasks))
        for job in jobs
    ]
