"""Lifetime-aware VM placement: lifetime classes, the LAS temporal cost, the LAVA host
state machine, the placement policies (best-fit, LA-Binary, LAS, LAVA) and the LARS
migration order.

Everything here is pure: no model, no clock, no I/O. Predictions come in as values
(``LifetimeEstimate`` for the VM being placed; re-predicted exit times through
``HostPool.update_exits``), so the learned model, an oracle and a test's stub are
interchangeable. Resources are two dimensions, ``cpu_milli`` and ``memory_mb``.

Host states (LAVA)::

    EMPTY --place VM of class c--> OPEN(c) --CPU or memory > 90 %--> RECYCLING(c)
    OPEN(c) / RECYCLING(c):
        deadline passed, VMs still there --> class up (c+1, or the class of the longest
                                              re-predicted residual VM if higher)
        residual VMs (class c) all gone  --> class down to the longest class left,
                                              OPEN if at most 90 % used, else RECYCLING
        last VM gone                     --> EMPTY

A RECYCLING host takes only VMs of a shorter class: they leave before its residual VMs,
so they fill its holes without extending its life.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np

HOUR_S = 3600.0

# Upper bounds of the lifetime classes 1..4 (<1h, 1-10h, 10-100h, 100-1000h). Class 4
# also takes anything longer: there is no fifth class to move to.
CLASS_UPPER_S = np.array([1.0, 10.0, 100.0, 1000.0]) * HOUR_S
NO_CLASS = 0
NUM_CLASSES = 4

# LAS: a host-lifetime extension is scored by the bucket it falls in, so placements
# that extend a host by "about the same" tie and best-fit decides among them.
LAS_COST_BUCKETS_S = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 12, 24, 168]) * HOUR_S

LA_BINARY_CUTOFF_S = 2 * HOUR_S
RECYCLE_UTILISATION = 0.9
NO_HOST = -1


class LifetimeClass(IntEnum):
    """Same numbers as the proto's ``LifetimeClass`` enum."""

    UNDER_1H = 1
    H1_TO_10H = 2
    H10_TO_100H = 3
    H100_TO_1000H = 4


class HostState(IntEnum):
    EMPTY = 0
    OPEN = 1
    RECYCLING = 2


# The states as plain ints for the hot paths: an IntEnum member looked up on its class
# costs a metaclass __getattr__ call each time (about a tenth of a LAVA simulation).
_EMPTY, _OPEN, _RECYCLING = (int(s) for s in HostState)


def lifetime_class(remaining_s: float | np.ndarray) -> np.ndarray:
    """Class 1..4 of a (remaining) lifetime; 1 h exactly is class 2, >= 1000 h is 4."""
    remaining = np.asarray(remaining_s, dtype=np.float64)
    return np.minimum(np.searchsorted(CLASS_UPPER_S, remaining, side="right") + 1, NUM_CLASSES)


def class_upper_s(lifetime_cls: int) -> float:
    """How long a VM of this class is expected to live at most (its class deadline)."""
    return float(CLASS_UPPER_S[int(lifetime_cls) - 1])


def temporal_cost_s(vm_exit_s: float | np.ndarray, host_exit_s: np.ndarray) -> np.ndarray:
    """LAS: how much placing the VM would extend each host's life, ``max(vm - host, 0)``."""
    return np.maximum(np.asarray(vm_exit_s) - np.asarray(host_exit_s), 0.0)


def quantise_cost(cost_s: float | np.ndarray) -> np.ndarray:
    """Bucket index of a temporal cost, rounding *up* to the next bucket edge.

    0 means no extension at all; k means ``edges[k-1] < cost <= edges[k]``; a cost past
    a week gets ``len(LAS_COST_BUCKETS_S)``. Rounding up keeps "no extension" strictly
    better than any extension, however small.
    """
    return np.searchsorted(LAS_COST_BUCKETS_S, np.asarray(cost_s, dtype=np.float64), side="left")


def lars_order(expected_remaining_s: Sequence[float] | np.ndarray) -> np.ndarray:
    """LARS: migrate the VMs of a draining host longest-predicted-remaining first, so the
    short ones have the time to leave by themselves. Ties keep the given order."""
    remaining = np.asarray(expected_remaining_s, dtype=np.float64)
    return np.argsort(-remaining, kind="stable")


def extension_curve(horizons_s: np.ndarray, mean_residual_s: np.ndarray) -> np.ndarray:
    """Expected host-life extension ``E[max(R - h, 0)]`` at each horizon ``h`` of a VM
    whose remaining lifetime ``R`` has, at the uptimes ``now + h``, the mean residual
    lifetimes ``mean_residual_s`` (``horizons_s[0]`` must be 0; rows are VMs).

    The mean residual life m(u) = E[T - u | T > u] determines the distribution:
    E[max(R - h, 0)] = P(R > h) m(h) = m(0) exp(-integral_0^h du / m(u)). So a model of
    E[remaining | uptime] alone gives LAS the *expected* extension over the predicted
    distribution (the integral by the trapezoid rule on the horizons). A point mass
    (m(u) = T - u, an oracle) gives back max(T - h, 0).
    """
    h = np.asarray(horizons_s, dtype=np.float64)
    m = np.maximum(np.asarray(mean_residual_s, dtype=np.float64), 1e-9)
    inv = 1.0 / m
    steps = 0.5 * (inv[..., 1:] + inv[..., :-1]) * np.diff(h)
    integral = np.concatenate([np.zeros((*m.shape[:-1], 1)), np.cumsum(steps, axis=-1)], axis=-1)
    return m[..., :1] * np.exp(-integral)


@dataclass(frozen=True)
class LifetimeEstimate:
    """What a predictor says about one VM: the expected remaining lifetime and, where the
    predictor has them, remaining-lifetime quantiles and the expected extension curve
    ``E[max(R - h, 0)]`` at horizons ``h`` (``extension_curve``)."""

    expected_remaining_s: float
    quantiles_s: tuple[float, ...] = ()
    quantile_levels: tuple[float, ...] = ()
    extension_horizons_s: np.ndarray | None = None
    extension_s: np.ndarray | None = None

    def expected_extension_s(self, horizon_s: np.ndarray) -> np.ndarray:
        """How long past ``horizon_s`` from now the VM is expected to live,
        ``E[max(R - h, 0)]``: from the curve when the predictor gave one, else from the
        expectation alone, ``max(E[R] - h, 0)``."""
        h = np.maximum(np.asarray(horizon_s, dtype=np.float64), 0.0)
        if self.extension_s is None or self.extension_horizons_s is None:
            return np.maximum(self.expected_remaining_s - h, 0.0)
        return np.interp(h, self.extension_horizons_s, self.extension_s)

    def quantile(self, level: float) -> float:
        """The quantile at ``level``; the expectation when the predictor gave none."""
        for q, value in zip(self.quantile_levels, self.quantiles_s, strict=True):
            if abs(q - level) < 1e-9:
                return value
        return self.expected_remaining_s


@dataclass(frozen=True)
class VmRequest:
    """A VM to place: its shape ``(cpu_milli, memory_mb)`` and the time of the decision."""

    shape: np.ndarray
    now_s: float


@dataclass
class HostPool:
    """The hosts as numpy columns plus a ledger of the VMs on them.

    ``adaptive`` turns on LAVA's class rules (deadline up, residual-gone down); other
    policies keep the tag the first VM gave a host until it empties.
    """

    capacity: np.ndarray  # (hosts, 2) float64: cpu_milli, memory_mb
    adaptive: bool = False
    used: np.ndarray = field(init=False)
    vm_count: np.ndarray = field(init=False)
    state: np.ndarray = field(init=False)
    host_class: np.ndarray = field(init=False)
    deadline_s: np.ndarray = field(init=False)
    exit_s: np.ndarray = field(init=False)
    available: np.ndarray = field(init=False)
    class_counts: np.ndarray = field(init=False)
    members: list[set[int]] = field(init=False)
    vm_host: dict[int, int] = field(init=False)
    vm_shape: dict[int, np.ndarray] = field(init=False)
    vm_tag: dict[int, int] = field(init=False)
    vm_exit_s: dict[int, float] = field(init=False)
    vm_placed_s: dict[int, float] = field(init=False)

    def __post_init__(self) -> None:
        self.capacity = np.asarray(self.capacity, dtype=np.float64).reshape(-1, 2)
        n = len(self.capacity)
        self.used = np.zeros((n, 2))
        self.vm_count = np.zeros(n, dtype=np.int64)
        self.state = np.full(n, HostState.EMPTY, dtype=np.int8)
        self.host_class = np.zeros(n, dtype=np.int8)
        self.deadline_s = np.full(n, np.inf)
        self.exit_s = np.full(n, -np.inf)  # latest predicted exit of the resident VMs
        self.available = np.ones(n, dtype=bool)  # False while a host drains
        self.class_counts = np.zeros((n, NUM_CLASSES + 1), dtype=np.int64)
        self.members = [set() for _ in range(n)]
        self.vm_host, self.vm_shape, self.vm_tag = {}, {}, {}
        self.vm_exit_s, self.vm_placed_s = {}, {}

    def __len__(self) -> int:
        return len(self.capacity)

    @property
    def free(self) -> np.ndarray:
        return self.capacity - self.used

    def fits(self, shape: np.ndarray) -> np.ndarray:
        """Hosts that can take ``shape`` now (and are not draining)."""
        return self.available & np.all(self.free >= shape, axis=1)

    def utilisation(self) -> np.ndarray:
        """Per host, the larger of the CPU and memory shares in use."""
        return (self.used / self.capacity).max(axis=1)

    def empty(self) -> np.ndarray:
        return self.vm_count == 0

    # --- the state machine -----------------------------------------------------------

    def place(self, vm: int, host: int, shape: np.ndarray, tag: int, exit_s: float, now_s: float):
        """Put VM ``vm`` of class ``tag`` (0: untagged) on ``host``; ``exit_s`` is its
        predicted exit time."""
        if vm in self.vm_host:
            raise ValueError(f"VM {vm} is already on host {self.vm_host[vm]}")
        shape = np.asarray(shape, dtype=np.float64)
        self.used[host] += shape
        self.vm_count[host] += 1
        self.members[host].add(vm)
        self.vm_host[vm], self.vm_shape[vm], self.vm_tag[vm] = host, shape, tag
        self.vm_exit_s[vm], self.vm_placed_s[vm] = exit_s, now_s
        self.class_counts[host, tag] += 1
        self.exit_s[host] = max(self.exit_s[host], exit_s)
        if self.state[host] == _EMPTY:
            self.state[host] = _OPEN
            self.host_class[host] = tag
            self.deadline_s[host] = now_s + class_upper_s(tag) if tag else np.inf
        elif not self.adaptive:
            pass  # the first VM's tag stays the host's label until it empties
        elif tag > self.host_class[host]:
            # A longer VM (a fallback placement) makes the host live longer: its class
            # follows, and the VMs of the old class become the shorter ones.
            self.host_class[host] = tag
            self.deadline_s[host] = now_s + class_upper_s(tag)
        elif tag == self.host_class[host]:
            self.deadline_s[host] = max(self.deadline_s[host], now_s + class_upper_s(tag))
        self._maybe_recycle(host)

    def release(self, vm: int, now_s: float) -> int:
        """Take VM ``vm`` off its host (it exited or migrated); return the host."""
        host = self.vm_host.pop(vm)
        shape = self.vm_shape.pop(vm)
        tag = self.vm_tag.pop(vm)
        self.vm_exit_s.pop(vm)
        self.vm_placed_s.pop(vm)
        self.members[host].discard(vm)
        self.used[host] = np.maximum(self.used[host] - shape, 0.0)
        self.vm_count[host] -= 1
        self.class_counts[host, tag] -= 1
        if self.vm_count[host] == 0:
            self._reset(host)
            return host
        self.exit_s[host] = max(self.vm_exit_s[v] for v in self.members[host])
        if self.adaptive and self.class_counts[host, self.host_class[host]] == 0:
            self._class_down(host)
        return host

    def update_exits(self, exit_s: dict[int, float]) -> None:
        """Re-predicted exit times of resident VMs; host exits follow (LAS, LAVA)."""
        self.vm_exit_s.update(exit_s)
        hosts = {self.vm_host[v] for v in exit_s}
        for host in hosts:
            self.exit_s[host] = max(self.vm_exit_s[v] for v in self.members[host])

    def advance(self, now_s: float, remaining_s: dict[int, float] | None = None) -> list[int]:
        """LAVA: bump the class of every host whose deadline passed with VMs still on it.

        The new class is one up, or the class of the longest re-predicted remaining
        lifetime among its residual VMs (``remaining_s``) when that is higher. The
        residual VMs are re-tagged with it. Returns the hosts bumped.
        """
        if not self.adaptive:
            return []
        occupied = (self.vm_count > 0) & (self.host_class > 0)
        late = np.flatnonzero(occupied & (self.deadline_s < now_s))
        for host in late:
            old = int(self.host_class[host])
            residual = [v for v in self.members[host] if self.vm_tag[v] == old]
            new = min(old + 1, NUM_CLASSES)
            if remaining_s and residual:
                longest = max(remaining_s.get(v, 0.0) for v in residual)
                new = max(new, int(lifetime_class(longest)))
            for v in residual:
                self.vm_tag[v] = new
            self.class_counts[host, old] -= len(residual)
            self.class_counts[host, new] += len(residual)
            self.host_class[host] = new
            self.deadline_s[host] = now_s + class_upper_s(new)
        return [int(h) for h in late]

    def _maybe_recycle(self, host: int) -> None:
        if (
            self.state[host] == _OPEN
            and (self.used[host] > RECYCLE_UTILISATION * self.capacity[host]).any()
        ):
            self.state[host] = _RECYCLING

    def _class_down(self, host: int) -> None:
        present = np.flatnonzero(self.class_counts[host])
        new = int(present.max()) if len(present) else NO_CLASS
        self.host_class[host] = new
        if new:
            # The remaining VMs of the new class were placed at various times: the
            # latest of their class deadlines is the host's.
            placed = max(self.vm_placed_s[v] for v in self.members[host] if self.vm_tag[v] == new)
            self.deadline_s[host] = placed + class_upper_s(new)
        else:
            self.deadline_s[host] = np.inf
        busy = (self.used[host] > RECYCLE_UTILISATION * self.capacity[host]).any()
        self.state[host] = _RECYCLING if busy else _OPEN

    def _reset(self, host: int) -> None:
        self.used[host] = 0.0
        self.state[host] = _EMPTY
        self.host_class[host] = NO_CLASS
        self.deadline_s[host] = np.inf
        self.exit_s[host] = -np.inf
        self.class_counts[host] = 0


# --- policies ---------------------------------------------------------------------------


class LifetimePolicy(Protocol):
    """One placement policy. ``choose_host`` returns a host index or ``NO_HOST``;
    ``tag`` is the class the pool records for the VM (0: the policy keeps none)."""

    name: str
    adaptive: bool
    uses_exits: bool  # needs re-predicted host exit times

    def tag(self, estimate: LifetimeEstimate) -> int: ...

    def choose_host(self, hosts: HostPool, vm: VmRequest, estimate: LifetimeEstimate) -> int: ...


def best_fit_among(hosts: HostPool, candidates: np.ndarray, shape: np.ndarray) -> int:
    """The candidate left with the least free room after placing ``shape`` (CPU and
    memory each as a share of the host), lowest index on ties; ``NO_HOST`` if none."""
    idx = np.flatnonzero(candidates)
    if len(idx) == 0:
        return NO_HOST
    return int(idx[np.argmin(room_left(hosts, idx, shape))])


def room_left(hosts: HostPool, idx: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Per host of ``idx``, the room left after placing ``shape``: CPU and memory each
    as a share of the host, summed (in [0, 2]); best-fit takes the least."""
    return ((hosts.free[idx] - shape) / hosts.capacity[idx]).sum(axis=1)


def first_among(candidates: np.ndarray) -> int:
    idx = np.flatnonzero(candidates)
    return int(idx[0]) if len(idx) else NO_HOST


class BestFitBaseline:
    """Baseline: ignore lifetimes; the fitting host with the least room left wins."""

    name = "best_fit"
    adaptive = False
    uses_exits = False

    def tag(self, estimate: LifetimeEstimate) -> int:
        return NO_CLASS

    def choose_host(self, hosts: HostPool, vm: VmRequest, estimate: LifetimeEstimate) -> int:
        return best_fit_among(hosts, hosts.fits(vm.shape), vm.shape)


class LaBinary:
    """One-shot prediction at creation, split at a 2 h cutoff (short = 1, long = 2).

    Algorithm: a host takes the label of the first VM it gets. Best-fit among the occupied
    hosts with the VM's label; a short VM may then take any occupied host (it does not
    extend a long one); else the first empty host; else best-fit among any host. The
    prediction is never revised: a mispredicted VM keeps its host's label wrong.
    """

    name = "la_binary"
    adaptive = False
    uses_exits = False

    def __init__(self, cutoff_s: float = LA_BINARY_CUTOFF_S):
        self.cutoff_s = cutoff_s

    def tag(self, estimate: LifetimeEstimate) -> int:
        return 2 if estimate.expected_remaining_s >= self.cutoff_s else 1

    def choose_host(self, hosts: HostPool, vm: VmRequest, estimate: LifetimeEstimate) -> int:
        fits = hosts.fits(vm.shape)
        label = self.tag(estimate)
        occupied = fits & ~hosts.empty()
        host = best_fit_among(hosts, occupied & (hosts.host_class == label), vm.shape)
        if host == NO_HOST and label == 1:  # a short VM does not extend a long host
            host = best_fit_among(hosts, occupied, vm.shape)
        if host == NO_HOST:
            host = first_among(fits & hosts.empty())
        if host == NO_HOST:
            host = best_fit_among(hosts, fits, vm.shape)
        return host


class Las:
    """Lifetime-aware scoring (NILAS): minimise how much a placement extends a host's life.

    Assumes ``hosts.exit_s`` holds each host's latest *re-predicted* VM exit (the
    simulator or GM refreshes it periodically). Algorithm: cost = quantised
    ``max(vm_exit - host_exit, 0)`` with an empty host's exit taken as now, or, when the
    estimate carries an extension curve, the expected extension ``E[max(R - h, 0)]``
    over the predicted distribution (h: time to the host's exit); lowest bucket wins,
    best-fit breaks ties (so a non-empty host wins a tie with an empty one).
    """

    name = "las"
    adaptive = False
    uses_exits = True

    def tag(self, estimate: LifetimeEstimate) -> int:
        return NO_CLASS

    def choose_host(self, hosts: HostPool, vm: VmRequest, estimate: LifetimeEstimate) -> int:
        return self.choose_host_among(hosts, hosts.fits(vm.shape), vm, estimate)

    def choose_host_among(
        self, hosts: HostPool, candidates: np.ndarray, vm: VmRequest, estimate: LifetimeEstimate
    ) -> int:
        idx = np.flatnonzero(candidates)
        if len(idx) == 0:
            return NO_HOST
        bucket = extension_buckets(hosts, idx, vm, estimate)
        return int(idx[np.argmin(las_scores(hosts, idx, vm, bucket))])


def extension_buckets(
    hosts: HostPool, idx: np.ndarray, vm: VmRequest, estimate: LifetimeEstimate
) -> np.ndarray:
    """LAS's cost of placing the VM on each host of ``idx``: the quantised (expected)
    extension of the host's life, an empty host's exit taken as now."""
    horizon = np.maximum(hosts.exit_s[idx], vm.now_s) - vm.now_s
    return quantise_cost(estimate.expected_extension_s(horizon))


def las_scores(hosts: HostPool, idx: np.ndarray, vm: VmRequest, bucket: np.ndarray) -> np.ndarray:
    """LAS's order over the hosts ``idx`` with extension buckets ``bucket``: the lowest
    bucket first, best-fit (``room_left``, in [0, 2]) within one; lowest wins."""
    return bucket * 4.0 + room_left(hosts, idx, vm.shape)


class Lava:
    """Lifetime-aware VM allocation with host lifetime classes and adaptation.

    Assumes the pool is ``adaptive`` (the class rules in ``HostPool``) and that the
    caller runs ``HostPool.advance`` periodically with re-predicted remaining lifetimes.
    Algorithm for a VM of class c (of its expected remaining lifetime):
      1. best-fit among RECYCLING hosts of a longer class (fills holes, no extension);
      2. best-fit among OPEN hosts of class c;
      3. best-fit among OPEN hosts of a longer class (no extension either);
      4. among the other occupied hosts, LAS (smallest quantised extension of the host's
         re-predicted exit, best-fit on ties); the host's class goes up to c if lower;
      5. the first EMPTY host (it opens with class c).
    Opening an empty host comes last: an empty host kept is the metric LAVA serves.
    """

    name = "lava"
    adaptive = True
    uses_exits = True

    def tag(self, estimate: LifetimeEstimate) -> int:
        return int(lifetime_class(estimate.expected_remaining_s))

    # What ``choose`` reports as the step that placed a VM (index into this tuple).
    STEPS = ("recycling_longer", "open_same", "open_longer", "las_occupied", "empty")

    def choose_host(self, hosts: HostPool, vm: VmRequest, estimate: LifetimeEstimate) -> int:
        return self.choose(hosts, vm, estimate)[0]

    def choose(self, hosts: HostPool, vm: VmRequest, estimate: LifetimeEstimate) -> tuple[int, int]:
        """The host and the step (``STEPS`` index) that chose it; ``(NO_HOST, -1)``."""
        fits = hosts.fits(vm.shape)
        c = self.tag(estimate)
        longer = hosts.host_class > c
        for step, candidates in enumerate(
            (
                fits & (hosts.state == _RECYCLING) & longer,
                fits & (hosts.state == _OPEN) & (hosts.host_class == c),
                fits & (hosts.state == _OPEN) & longer,
            )
        ):
            host = best_fit_among(hosts, candidates, vm.shape)
            if host != NO_HOST:
                return host, step
        # Nothing lifetime-compatible: the smallest host-lifetime extension (LAS) among
        # the occupied hosts, and an empty host only when none fits at all.
        host = Las().choose_host_among(hosts, fits & ~hosts.empty(), vm, estimate)
        if host != NO_HOST:
            return host, 3
        host = first_among(fits & hosts.empty())
        return host, (4 if host != NO_HOST else -1)


POLICIES: dict[str, type] = {p.name: p for p in (BestFitBaseline, LaBinary, Las, Lava)}


def make_lifetime_policy(name: str) -> LifetimePolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
