"""Matching a task to a node (paper Alg. 1): feasibility by bit-vectors, fit by a policy.

    constraint bit-vectors ──AND──> candidates ──policy.select──> node row (or -1)
    (alive & partition & each                   (first fit, best fit, GPA, ...)
     required constraint)

The GM runs this on its (possibly stale) view; the LM runs ``policy.fits`` on its
authoritative books with the same policy object, so a disagreement between them comes
from state, never from code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np
from bitarray import bitarray
from bitarray.util import ones, zeros

from services.core.constraints import describe_constraints, from_mask
from services.core.gpa import DEFAULT_RHO, GpaPolicy
from services.core.node_table import NodeTable, bools_from_bits
from services.core.resources import CPU, RESOURCE_NAMES, format_resources
from services.core.status import Schedulability, Verdict
from services.core.task import TaskSpec

NO_NODE = -1


def candidates(
    table: NodeTable,
    constraint_mask: int,
    within: bitarray | None = None,
    *,
    alive_only: bool = True,
) -> bitarray:
    """Nodes of ``within`` (default: all) that satisfy every required constraint and,
    unless ``alive_only`` is off, are alive."""
    if constraint_mask >> table.num_constraints:
        # The task needs a constraint this table does not even track: nobody has it.
        return zeros(table.size, endian="big")
    if within is None:
        cand = table.alive.copy() if alive_only else ones(table.size, endian="big")
    else:
        cand = table.alive & within if alive_only else within.copy()
    for c in from_mask(constraint_mask):
        cand &= table.constraint_bits[c]
    return cand


class PlacementPolicy(Protocol):
    """Scores candidates and checks one node. Both GM (select) and LM (fits) use it.

    ``extra_free`` in ``fits`` is resources about to be freed on the node (preemption
    victims), so the LM asks "would it fit once these are gone?" with the same code.
    """

    name: str
    # True when a task that asks for CPU fits only where CPU is free (no
    # oversubscription): an LM whose nodes have none free then offers nothing
    # (``NodeTable.has_cpu``), which a caller may check before calling ``select``.
    strict_cpu: bool

    def select(self, table: NodeTable, cand: bitarray, task: TaskSpec) -> int: ...

    def fits(
        self, table: NodeTable, node: int, task: TaskSpec, extra_free: np.ndarray | None = None
    ) -> bool: ...


class StrictFit:
    """Shared ``fits``: every requested quantity is free on the node (no oversubscription)."""

    strict_cpu = True

    def fits(
        self, table: NodeTable, node: int, task: TaskSpec, extra_free: np.ndarray | None = None
    ) -> bool:
        free = table.free[:, node]
        if extra_free is not None:
            free = free + extra_free
        # Four numbers: compared as Python ints, a numpy comparison costs more than it.
        return all(f >= r for f, r in zip(free.tolist(), task.resources.tolist(), strict=True))


_FEW_CANDIDATES = 4  # FirstFit tests up to this many candidates one by one


class FirstFit(StrictFit):
    """The lowest-numbered candidate with enough free resources (the paper's choice).

    Algorithm: drop the candidates without free CPU (``NodeTable.has_cpu``, one AND: on
    a full federation most misses end here); find the first candidate bit; test a window
    of rows starting there with one numpy comparison per requested resource; if none
    fits, jump to the next candidate past the window and grow the window 4x. Typical
    matches touch one small window; a miss costs O(n) vector work and no Python loop
    over nodes.
    """

    name = "first-fit"
    first_window = 256

    def select(self, table: NodeTable, cand: bitarray, task: TaskSpec) -> int:
        request = task.resources
        if request[CPU] > 0:
            cand = cand & table.has_cpu  # a node without free CPU is no candidate
        pos = cand.find(1)
        if pos < 0:
            return NO_NODE
        dims = np.flatnonzero(request).tolist()
        free = table.free
        if cand.count() <= _FEW_CANDIDATES:
            # A few candidates left (a full federation's usual case): test them one by one
            # rather than unpack a window of bits around them.
            wanted = [(d, int(request[d])) for d in dims]
            for node in cand.search(1):
                if all(free[d, node] >= need for d, need in wanted):
                    return node
            return NO_NODE
        n = len(cand)
        window = self.first_window
        while pos >= 0:
            start = pos & ~7  # byte-aligned slices of a bitarray are cheap to unpack
            stop = min(n, start + window)
            ok = bools_from_bits(cand, start, stop)
            for d in dims:
                ok &= free[d, start:stop] >= request[d]
            hit = int(ok.argmax())
            if ok[hit]:
                return start + hit
            if stop >= n:
                break
            pos = cand.find(1, stop)
            window *= 4
        return NO_NODE


class BestFit(StrictFit):
    """The candidate left with the least normalised free room after placement.

    Scans every candidate (a dense bin-packing choice costs O(n) by nature).
    """

    name = "best-fit"

    def select(self, table: NodeTable, cand: bitarray, task: TaskSpec) -> int:
        request = task.resources
        if request[CPU] > 0:
            cand = cand & table.has_cpu  # a node without free CPU is no candidate
        if not cand.any():
            return NO_NODE
        ok = bools_from_bits(cand)
        free = table.free
        for d in np.flatnonzero(request).tolist():
            ok &= free[d] >= request[d]
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            return NO_NODE
        cap = np.maximum(table.capacity[:, rows], 1)
        leftover = ((free[:, rows] - request[:, None]) / cap).sum(axis=0)
        return int(rows[int(leftover.argmin())])


POLICIES: dict[str, type] = {"first-fit": FirstFit, "best-fit": BestFit, "gpa": GpaPolicy}


def make_policy(name: str, *, rho: float | None = None) -> PlacementPolicy:
    """The policy called ``name``; ``rho`` is GPA's SLO (default ``gpa.DEFAULT_RHO``)."""
    if name == "gpa":
        return GpaPolicy(DEFAULT_RHO if rho is None else rho)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; known: {sorted(POLICIES)}") from None


def match(
    table: NodeTable, task: TaskSpec, policy: PlacementPolicy, within: bitarray | None = None
) -> int:
    """The node row ``policy`` picks for ``task`` among ``within``, or ``NO_NODE``."""
    return policy.select(table, candidates(table, task.constraint_mask, within), task)


# --------------------------------------------------------------------------- explaining
def assess(
    tables: Iterable[NodeTable],
    task: TaskSpec,
    policy: PlacementPolicy | None = None,
    labels: Mapping[int, str] | None = None,
) -> Verdict:
    """Can ``task`` be placed now, later, or never? With the reason a user can act on.

    Never (INFEASIBLE): no registered node, alive or not, has the constraints and the
    capacity. Later (UNSCHEDULABLE): some node could hold it but none has room now.
    "Now" is strict (free >= request) unless ``policy`` is given, which then decides
    (GPA may place where free cpu is short, or refuse where it is not). ``labels``: the
    federation's names of constraint ids, for the reasons.
    """
    tables = list(tables)
    request = task.resources
    has_constraint = 0  # constraints some node has
    best_capacity: tuple[float, np.ndarray] | None = None
    best_free: tuple[float, np.ndarray] | None = None
    any_match = False
    for table in tables:
        if table.size == 0:
            continue
        for c in from_mask(task.constraint_mask):
            if c < table.num_constraints and table.constraint_bits[c].any():
                has_constraint |= 1 << c
        cand = candidates(table, task.constraint_mask, alive_only=False)
        rows = np.flatnonzero(bools_from_bits(cand))
        if rows.size == 0:
            continue
        any_match = True
        cap_best = _closest(table.capacity[:, rows], request)
        if best_capacity is None or cap_best[0] > best_capacity[0]:
            best_capacity = cap_best
        alive_rows = rows[bools_from_bits(table.alive)[rows]]
        if alive_rows.size:
            free_best = _closest(table.free[:, alive_rows], request)
            if best_free is None or free_best[0] > best_free[0]:
                best_free = free_best
    missing = task.constraint_mask & ~has_constraint
    if missing:
        names = describe_constraints(from_mask(missing), labels)
        return Verdict(Schedulability.INFEASIBLE, f"no node has constraint {names}")
    if not any_match and not task.constraint_mask:
        return Verdict(Schedulability.INFEASIBLE, "no worker node has registered")
    if not any_match:
        wanted = describe_constraints(from_mask(task.constraint_mask), labels)
        return Verdict(Schedulability.INFEASIBLE, f"no node has constraints {wanted} together")
    assert best_capacity is not None
    if best_capacity[0] < 1.0:
        short = _shortfall(best_capacity[1], request)
        return Verdict(
            Schedulability.INFEASIBLE,
            f"no node is large enough: needs {format_resources(request)}; largest matching "
            f"node has {format_resources(best_capacity[1])} ({short})",
        )
    if best_free is None:
        return Verdict(Schedulability.UNSCHEDULABLE, "every node that could hold it is dead")
    if policy is not None:
        now = any(
            policy.select(t, candidates(t, task.constraint_mask), task) != NO_NODE
            for t in tables
            if t.size
        )
    else:
        now = best_free[0] >= 1.0
    if now:
        return Verdict(Schedulability.SCHEDULABLE, "")
    if isinstance(policy, GpaPolicy):
        return Verdict(
            Schedulability.UNSCHEDULABLE,
            f"waiting for resources: needs {format_resources(request)}; no matching node has "
            f"the memory, disk and network free and passes the GPA cpu test "
            f"(P(cpu usage > capacity) <= {policy.rho:g})",
        )
    return Verdict(
        Schedulability.UNSCHEDULABLE,
        f"waiting for resources: needs {format_resources(request)}; largest free on a "
        f"matching node: {format_resources(np.maximum(best_free[1], 0))} "
        f"({_shortfall(best_free[1], request)})",
    )


def _closest(vectors: np.ndarray, request: np.ndarray) -> tuple[float, np.ndarray]:
    """The column that comes closest to holding ``request``: max over columns of the
    smallest per-resource ratio have/need (>= 1 means it fits)."""
    need = request > 0
    ratios = vectors[need] / request[need][:, None]
    worst = ratios.min(axis=0)
    best = int(worst.argmax())
    return float(worst[best]), vectors[:, best].copy()


def _shortfall(have: np.ndarray, request: np.ndarray) -> str:
    short = [RESOURCE_NAMES[d] for d in np.flatnonzero(have < request)]
    return "short of " + ", ".join(short) if short else "fits"
