"""Gridiron's virtual datacenters (VDCs): a gang's network demand derived from its compute.

Model (Gridiron, after Amdahl's second law):

- A VDC is an all-to-all group of P members. The **vlink** between members i and j
  carries ``bandwidth_per_core x min(cores_i, cores_j)`` Mbit/s, capped at ``vlink_cap``.
- A vlink between two members on the same node never leaves it; one between members on
  different nodes crosses both nodes' **uplinks**. A node hosting D of P uniform members
  carries D x (P - D) vlinks; for non-uniform members, the sum over hosted i and
  non-hosted j of vlink(i, j). Colocating members therefore *saves* uplink: the demand is
  0 at D = P and largest at D = P/2.
- A node's uplink capacity is its ``net_mbps`` resource (resources.py: every node already
  offers it, and an LM's books already take a task's ``net_mbps`` off it). So a member's
  **uplink share** (the vlinks from it to members on other nodes) is booked as that
  member's ``net_mbps``, and a node's free ``net_mbps`` is its free uplink. The share
  *replaces* the task's own ``net_mbps`` request: under ``--gridiron`` that request is
  the worst case of the same traffic (every vlink crossing the uplink), counted again it
  would book the traffic twice.

Assumptions:

- Arithmetic is exact integers, so the GM that plans and the LM that validates agree to
  the bit: a vlink is rounded up to whole kbit/s, a member's share up to whole Mbit/s.
  Rounding up over-books a node by less than 1 Mbit/s per hosted member, never under.
- A member not placed (slot -1: a ``min_tasks`` gang started without it) counts as being
  on another node: the booked shares cover its vlinks when it joins later, on any node.
- Only the uplinks are modelled; the fabric above them is not (Gridiron's caps keep it
  feasible).

Names: a **slot** is a node as the planner numbers the nodes it considers (a GM numbers
every candidate node of every LM; an LM checks the slots that are its own nodes and
passes ``UNJUDGED`` for the rest).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.core.resources import CPU, NET, NUM_RESOURCES, RESOURCE_NAMES, format_resources
from services.core.status import Schedulability, Verdict

# The free uplink to pass for a slot the caller does not judge (another LM's node).
UNJUDGED = np.iinfo(np.int64).max
NOT_PLACED = -1
_KBPS_PER_MBPS = 1000


class VdcError(ValueError):
    """A VDC is invalid; the message says why."""


@dataclass(frozen=True, slots=True)
class Vdc:
    """Gridiron's VDC parameters: ``bandwidth_per_core`` (bpc) and ``vlink_cap`` (B),
    both in Mbit/s. With the datacenter-aware cap ``B <= 4C / P**2`` every placement fits
    an empty uplink C; a larger B is allowed and simply needs more colocation."""

    bandwidth_per_core: float
    vlink_cap: float

    def __post_init__(self) -> None:
        for name in ("bandwidth_per_core", "vlink_cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise VdcError(f"{name} must be a number of Mbit/s, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise VdcError(f"{name} must be finite and >= 0 Mbit/s, got {value!r}")

    def vlinks_kbps(self, cpu_milli: np.ndarray) -> np.ndarray:
        """The (P, P) vlink matrix in whole kbit/s (rounded up), 0 on the diagonal."""
        cores = np.asarray(cpu_milli, dtype=np.float64) / 1000.0
        mbps = np.minimum(self.bandwidth_per_core * np.minimum.outer(cores, cores), self.vlink_cap)
        kbps = np.ceil(mbps * _KBPS_PER_MBPS - 1e-6).astype(np.int64)
        np.fill_diagonal(kbps, 0)
        return kbps


def _kbps_to_mbps(kbps: np.ndarray) -> np.ndarray:
    return -((-kbps) // _KBPS_PER_MBPS)  # integer ceiling


def member_uplink(vdc: Vdc, cpu_milli: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Each member's uplink share (Mbit/s, int64): its vlinks to members not on its slot.
    0 for a member not placed (``NOT_PLACED``)."""
    slots = np.asarray(slots, dtype=np.int64)
    links = vdc.vlinks_kbps(cpu_milli)
    placed = slots >= 0
    apart = slots[:, None] != slots[None, :]
    share = _kbps_to_mbps(np.where(apart, links, 0).sum(axis=1))
    share[~placed] = 0
    return share


def uplink_demand(vdc: Vdc, cpu_milli: np.ndarray, slots: np.ndarray, num_slots: int) -> np.ndarray:
    """The VDC's traffic over each slot's uplink (Mbit/s, int64, length ``num_slots``):
    the sum of its hosted members' shares (uniform members: D x (P - D) x vlink)."""
    slots = np.asarray(slots, dtype=np.int64)
    share = member_uplink(vdc, cpu_milli, slots)
    placed = slots >= 0
    demand = np.zeros(num_slots, dtype=np.int64)
    np.add.at(demand, slots[placed], share[placed])
    return demand


@dataclass(frozen=True, slots=True)
class UplinkFit:
    """``fits_uplinks``'s verdict: whether every judged uplink holds the VDC's traffic,
    the demand per slot, and (when not) the reason a person can act on."""

    fits: bool
    demand: np.ndarray
    reason: str = ""

    def __bool__(self) -> bool:
        return self.fits


def fits_uplinks(
    vdc: Vdc,
    cpu_milli: np.ndarray,
    slots: np.ndarray,
    free_uplink: np.ndarray,
    names: list[str] | None = None,
) -> UplinkFit:
    """Does the VDC's traffic fit every slot's free uplink? The GM plans with this and an
    LM validates with it (``free_uplink`` = ``UNJUDGED`` for slots not its own)."""
    free_uplink = np.asarray(free_uplink, dtype=np.int64)
    demand = uplink_demand(vdc, cpu_milli, slots, len(free_uplink))
    # A GM's view may show a node booked past its uplink for a moment (two GMs took the
    # same room): that is no reason to refuse a VDC that sends nothing over it.
    over = demand > np.maximum(free_uplink, 0)
    if not over.any():
        return UplinkFit(True, demand)
    # Formatting only on the way out: a refusal is the rare path.
    k = int(np.flatnonzero(over)[0])
    hosted = int((np.asarray(slots) == k).sum())
    name = names[k] if names is not None else f"slot {k}"
    return UplinkFit(
        False,
        demand,
        f"node {name} would carry {int(demand[k])} Mbit/s of VDC traffic ({hosted} of "
        f"{len(slots)} members there) over an uplink with {int(free_uplink[k])} Mbit/s free",
    )


# ----------------------------------------------------------------------------- packing
@dataclass(frozen=True, slots=True)
class Packing:
    """A placement of a gang's members on slots: ``slots[i]`` (``NOT_PLACED`` if none)
    and ``booked[i]``, the vector to book for member i (with a VDC its ``net_mbps`` is
    its uplink share)."""

    slots: np.ndarray
    booked: np.ndarray
    placed: int


class Colocate:
    """Gang placement that packs members onto as few nodes as resources allow.

    Assumptions: members' requests are strict (free >= request, no GPA oversubscription);
    every slot offered is one every member may use (the caller has applied constraints,
    liveness and partitions); a node takes members in one step (it is not revisited);
    members go in size order, so when the largest left fits on no open node packing
    stops there (for a ``min_members`` gang of unlike members a finer packer could place
    more of the small ones; a job's members are alike as a rule).

    Algorithm, per step, until every member has a slot or none can take one:
      1. Order the members left by size, largest first (cpu, then memory).
      2. For every open slot, count how many of them (a prefix of that order) its free
         room holds: a ``searchsorted`` per resource over the prefix sums.
      3. With a VDC, the prefix of d members on a slot would send ``demand[d]`` over its
         uplink (everyone else is elsewhere); keep the largest d whose demand fits too.
      4. Put that many on the slot that takes the most (ties: the lowest slot, which the
         caller numbers in order of preference), and close the slot.
    Packing is what saves uplink (D x (P - D) falls as D grows past P/2), so the policy
    prefers colocation whenever bandwidth is scarce, and costs nothing when it is not.
    The result is checked whole with ``fits_uplinks`` (the LM's own test) before it is
    returned: a plan never over-commits an uplink.

    ``place`` returns a ``Packing`` or a ``Verdict``: UNSCHEDULABLE when the gang does not
    fit now, INFEASIBLE when this policy would not place it even on the empty nodes
    (``capacity``), so waiting cannot help.
    """

    name = "colocate"

    def place(
        self,
        requests: np.ndarray,
        free: np.ndarray,
        capacity: np.ndarray | Callable[[], np.ndarray] | None,
        vdc: Vdc | None = None,
        min_members: int | None = None,
    ) -> Packing | Verdict:
        """``requests`` (P, NUM_RESOURCES), ``free`` (NUM_RESOURCES, K) of the slots,
        ``capacity`` (NUM_RESOURCES, K') of every slot that could ever take the gang (or a
        function returning it, called only when the gang does not fit now; None: do not
        judge "never", a gang that does not fit now is UNSCHEDULABLE); at least
        ``min_members`` (default all) members or nothing."""
        requests = np.asarray(requests, dtype=np.int64)
        count = len(requests)
        need = count if min_members is None else min_members
        if not 1 <= need <= count:
            raise ValueError(f"min_members must be in 1..{count}, got {need}")
        packing, why = self._pack(requests, np.asarray(free, dtype=np.int64), vdc, need)
        if packing.placed >= need:
            return packing
        if callable(capacity):
            capacity = capacity()
        never, never_why = (
            (packing, "")
            if capacity is None
            else self._pack(requests, np.asarray(capacity, dtype=np.int64), vdc, need)
        )
        if capacity is not None and never.placed < need:
            return Verdict(
                Schedulability.INFEASIBLE,
                f"the gang cannot start even on empty nodes ({need} of its {count} members "
                f"together): {never_why}",
            )
        return Verdict(
            Schedulability.UNSCHEDULABLE,
            f"waiting for room for the whole gang ({need} of its {count} members together): {why}",
        )

    def _pack(
        self, requests: np.ndarray, free: np.ndarray, vdc: Vdc | None, need: int
    ) -> tuple[Packing, str]:
        count, num_slots = len(requests), free.shape[1]
        slots = np.full(count, NOT_PLACED, dtype=np.int64)
        booked = requests.copy()
        if vdc is not None:
            booked[:, NET] = 0  # replaced by the uplink share, added below
        # A cheap bound first: a gang waiting on a busy federation is planned again on
        # every view change, and most of those times all the free room together is short.
        # (Any ``need`` members ask at least the ``need`` smallest quantities, per resource.)
        total_free = np.maximum(free, 0).sum(axis=1)
        total_need = np.sort(booked, axis=0)[:need].sum(axis=0)
        if (total_need > total_free).any():
            short = np.flatnonzero(total_need > total_free)
            names = ", ".join(RESOURCE_NAMES[d] for d in short)
            empty = Packing(slots, booked, 0)
            return empty, (
                f"all the room together is short of {names}: the members need at least "
                f"{format_resources(total_need)}, the nodes have {format_resources(total_free)}"
            )
        # Only nodes that hold the smallest quantities any member asks can take one: on a
        # busy federation most cannot, and every step below costs O(members x nodes).
        # (Free uplink is not a filter: a node hosting the whole VDC sends nothing.)
        smallest = booked.min(axis=0)
        useful = np.flatnonzero((free >= smallest[:, None]).all(axis=0))
        if not len(useful):
            return Packing(slots, booked, 0), (
                f"no node has room for a member: none has {format_resources(smallest)} free"
            )
        if len(useful) < num_slots:
            packing, why = self._pack_on(requests, booked, free[:, useful], vdc)
            placed = packing.slots >= 0
            packing.slots[placed] = useful[packing.slots[placed]]
            return packing, why
        return self._pack_on(requests, booked, free, vdc)

    def _pack_on(
        self, requests: np.ndarray, booked: np.ndarray, free: np.ndarray, vdc: Vdc | None
    ) -> tuple[Packing, str]:
        count, num_slots = len(requests), free.shape[1]
        slots = np.full(count, NOT_PLACED, dtype=np.int64)
        booked = booked.copy()
        if vdc is not None:
            links = vdc.vlinks_kbps(requests[:, CPU])
            row_total = links.sum(axis=1)
        # Largest first: big members find room while nodes are empty.
        order = np.lexsort((-requests[:, 1], -requests[:, CPU]))
        left = order
        is_open = np.ones(num_slots, dtype=bool)
        demand: np.ndarray | None = None
        why = ""
        while len(left):
            prefix = np.cumsum(booked[left], axis=0)  # (n, R), non-decreasing
            n = len(left)
            fit = np.full(num_slots, n, dtype=np.int64)
            for d in range(NUM_RESOURCES):  # R = 4 searches of K values each
                fit = np.minimum(fit, np.searchsorted(prefix[:, d], free[d], side="right"))
            fit[~is_open] = 0
            sizes = np.arange(1, n + 1)
            ok = sizes[:, None] <= fit[None, :]  # (n, K)
            if vdc is not None:
                demand = _prefix_demand(links, row_total, left)  # (n,): d = 1..n
                ok &= demand[:, None] <= free[NET][None, :]
            any_ok = ok.any(axis=0)
            best = np.where(any_ok, n - np.argmax(ok[::-1], axis=0), 0)
            slot = int(np.argmax(best))
            take = int(best[slot])
            if take == 0:
                why = f"{count - len(left)} placed, then " + _why_stuck(
                    requests[left[0]], fit, demand, free, is_open
                )
                break
            slots[left[:take]] = slot
            is_open[slot] = False
            left = left[take:]
        if vdc is not None:
            booked[:, NET] = member_uplink(vdc, requests[:, CPU], slots)
        placed = int((slots >= 0).sum())
        packing = Packing(slots, booked, placed)
        # The whole plan through the LM's tests: a bug here must refuse, not over-commit.
        if placed and not _holds(packing, free, vdc, requests):
            empty = Packing(np.full(count, NOT_PLACED), requests.copy(), 0)
            return empty, "the plan failed its own final check (a bug): nothing placed"
        return packing, why


def _prefix_demand(links: np.ndarray, row_total: np.ndarray, left: np.ndarray) -> np.ndarray:
    """Uplink demand (Mbit/s) of a slot hosting the first d of ``left``, for d = 1..n:
    each hosted member's share is its total vlinks less those to the hosted ones."""
    inner = np.cumsum(links[np.ix_(left, left)], axis=1)  # [a, d-1]: a's links to first d
    share = _kbps_to_mbps(row_total[left][:, None] - inner)
    n = len(left)
    hosted = np.arange(n)[:, None] <= np.arange(n)[None, :]  # member a among the first d
    return np.where(hosted, share, 0).sum(axis=0)


def _holds(packing: Packing, free: np.ndarray, vdc: Vdc | None, requests: np.ndarray) -> bool:
    placed = packing.slots >= 0
    used = np.zeros_like(free)
    np.add.at(used.T, packing.slots[placed], packing.booked[placed])
    hosting = np.unique(packing.slots[placed])
    if (used[:, hosting] > free[:, hosting]).any():
        return False
    return vdc is None or fits_uplinks(vdc, requests[:, CPU], packing.slots, free[NET]).fits


def _why_stuck(
    member: np.ndarray,
    fit: np.ndarray,
    demand: np.ndarray | None,
    free: np.ndarray,
    is_open: np.ndarray,
) -> str:
    """Why no open slot takes the next member (the largest left), for a person."""
    if demand is None or not (fit > 0).any():
        if not is_open.any():
            return f"every one of the {len(is_open)} usable nodes already took members"
        room = free[:, is_open]
        roomiest = room[:, int(np.argmax(room[CPU]))]
        return (
            f"no node left has room for the next member ({format_resources(member)}); the "
            f"one with the most cpu free has {format_resources(np.maximum(roomiest, 0))}"
        )
    most = int(fit.max())
    least = int(np.argmin(demand[:most]))
    up = int(free[NET][fit > 0].max())
    return (
        f"the nodes with room lack uplink: the least VDC traffic one would carry is "
        f"{int(demand[least])} Mbit/s (hosting {least + 1} members), the most free uplink "
        f"among them is {up} Mbit/s"
    )
