"""The column store of one LM's nodes, shared by the LM's books and the GM's view of them.

Nodes are rows ``0..n-1`` that never move (a dead node keeps its row), so an index is a
stable node address on the wire for the node's life. A node the LM forgets (lost for
``forget_lost_after_s``) leaves a *vacant* row (``vacate``: no id, nothing in it, dead),
which the next new node takes (``add``): a forged or churning stream of node ids does not
grow the table for ever. A row changes node only after its node was lost that long, so a
request naming it has long expired. Numbers live in numpy arrays laid out resource-major
(``free[d, i]``), so "free cpu of every node" is one contiguous slice. Sets of nodes
(alive, each constraint, each partition) are bitarrays, so a candidate set is a few ANDs.
The numpy arrays are the truth; the bitarrays are kept in step by every mutator.

For GPA each node also carries running sums over its running tasks' CPU usage: means
(``usage_mean``, millicores) and variances (``usage_var``, millicores^2), float64. They are
books like ``free``: whoever changes ``free`` for a task changes them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from bitarray import bitarray

from services.core.constraints import DEFAULT_NUM_CONSTRAINTS, MAX_CONSTRAINTS
from services.core.resources import CPU, NUM_RESOURCES


@dataclass(slots=True)
class NodeColumns:
    """Static facts of a batch of nodes, column-wise (what a snapshot carries)."""

    indices: np.ndarray  # uint32 (k,)
    node_ids: list[str]
    addresses: list[str]
    capacity: np.ndarray  # int64 (NUM_RESOURCES, k)
    constraint_masks: np.ndarray  # uint64 (k,)
    partitions: np.ndarray  # int32 (k,)
    alive: np.ndarray  # bool (k,)

    def __len__(self) -> int:
        return len(self.indices)


def bits_from_bools(values: np.ndarray) -> bitarray:
    """A big-endian bitarray with bit i = values[i] (vectorised through packbits)."""
    out = bitarray(endian="big")
    out.frombytes(np.packbits(values.astype(bool, copy=False)).tobytes())
    del out[len(values) :]
    return out


def bools_from_bits(bits: bitarray, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The inverse of ``bits_from_bools`` for ``bits[start:stop]``; ``start`` byte-aligned."""
    stop = len(bits) if stop is None else stop
    raw = np.frombuffer(bits[start:stop].tobytes(), dtype=np.uint8)
    return np.unpackbits(raw, count=stop - start).view(bool)


# Up to this many rows, ``set_free`` sets their ``has_cpu`` bits one by one rather than
# rebuilding the bitarray: a loop over a few rows costs less than packbits' overhead.
_FEW_ROWS = 64


class NodeTable:
    """Nodes of one LM: capacity, free resources, constraints, liveness, owner partition."""

    def __init__(self, num_partitions: int, num_constraints: int = DEFAULT_NUM_CONSTRAINTS):
        if not 0 < num_constraints <= MAX_CONSTRAINTS:
            raise ValueError(f"num_constraints must be in 1..{MAX_CONSTRAINTS}")
        if num_partitions < 1:
            raise ValueError("a node table needs at least one partition")
        self.num_constraints = num_constraints
        self.num_partitions = num_partitions
        self.size = 0
        self.node_ids: list[str] = []
        self.addresses: list[str] = []
        self._index_of: dict[str, int] = {}
        cap = 16
        self._capacity = np.zeros((NUM_RESOURCES, cap), dtype=np.int64)
        self._free = np.zeros((NUM_RESOURCES, cap), dtype=np.int64)
        self._free_view: np.ndarray | None = None  # ``free``'s, while the table keeps its size
        self._usage_mean = np.zeros(cap, dtype=np.float64)
        self._usage_var = np.zeros(cap, dtype=np.float64)
        self._masks = np.zeros(cap, dtype=np.uint64)
        self._owner = np.zeros(cap, dtype=np.int32)
        self.alive = bitarray(endian="big")
        # Nodes with some free CPU (``free[CPU] > 0``), kept in step with ``free``: a
        # node without any fits no task that asks for CPU, so a policy can drop it from
        # the candidates with one AND before any numpy work (on a full federation most
        # matches find every candidate full: a miss then costs no unpacking).
        self.has_cpu = bitarray(endian="big")
        self.constraint_bits = [bitarray(endian="big") for _ in range(num_constraints)]
        self.members = [bitarray(endian="big") for _ in range(num_partitions)]
        # Rows no node holds (``vacate``, or gaps a snapshot left): no id, nothing in them.
        self.vacant: set[int] = set()
        # Bumped by every mutator: lets a caller remember "no node fits this shape" for as
        # long as the table has not changed (GlobalView's miss cache).
        self.version = 0
        # Bumped only when nodes, capacities or constraints change: what a task could
        # ever get here (GlobalView's feasibility cache).
        self.static_version = 0

    # ----------------------------------------------------------------- views
    @property
    def capacity(self) -> np.ndarray:
        return self._capacity[:, : self.size]

    @property
    def free(self) -> np.ndarray:
        """Read-only: change it through ``take``, ``give_back`` or ``set_free``, which
        keep ``has_cpu`` in step."""
        view = self._free_view
        if view is None or view.shape[1] != self.size or view.base is not self._free:
            # Made again only when the table grows: a placement reads it for every
            # candidate window, and a fresh read-only view costs more than the read.
            view = self._free_view = self._free[:, : self.size]
            view.flags.writeable = False
        return view

    @property
    def usage_mean(self) -> np.ndarray:
        """Sum of the running tasks' CPU usage means per node (millicores)."""
        return self._usage_mean[: self.size]

    @property
    def usage_var(self) -> np.ndarray:
        """Sum of the running tasks' CPU usage variances per node (millicores^2)."""
        return self._usage_var[: self.size]

    @property
    def constraint_masks(self) -> np.ndarray:
        return self._masks[: self.size]

    @property
    def owner(self) -> np.ndarray:
        return self._owner[: self.size]

    def index_of(self, node_id: str) -> int | None:
        return self._index_of.get(node_id)

    def is_alive(self, index: int) -> bool:
        return bool(self.alive[index])

    def satisfies(self, index: int, constraint_mask: int) -> bool:
        return int(self._masks[index]) & constraint_mask == constraint_mask

    def occupied(self) -> np.ndarray:
        """The rows a node holds (every row but the vacant ones), ascending."""
        rows = np.arange(self.size, dtype=np.int64)
        if not self.vacant:
            return rows
        return np.setdiff1d(rows, np.fromiter(self.vacant, np.int64, len(self.vacant)))

    # ------------------------------------------------------------- mutators
    def add(
        self,
        node_id: str,
        capacity: np.ndarray,
        constraint_mask: int,
        partition: int,
        address: str = "",
        alive: bool = True,
    ) -> int:
        """Add a node (free = capacity) in the lowest vacant row, else a new one; its row."""
        if not node_id:
            raise ValueError("a node needs an id")
        if node_id in self._index_of:
            raise ValueError(f"node {node_id!r} is already registered")
        if not 0 <= partition < self.num_partitions:
            raise ValueError(f"partition {partition} out of range 0..{self.num_partitions - 1}")
        self.version += 1
        self.static_version += 1
        if self.vacant:
            i = min(self.vacant)
            self.vacant.discard(i)
            self._fill(i, node_id, address, capacity, constraint_mask, partition, alive)
            return i
        i = self.size
        self._grow(i + 1)
        self.size += 1
        # A new row at the end of every column, then filled as a vacant one is.
        self.node_ids.append("")
        self.addresses.append("")
        self.alive.append(False)
        self.has_cpu.append(False)
        for bits in self.constraint_bits:
            bits.append(0)
        for bits in self.members:
            bits.append(False)
        self._fill(i, node_id, address, capacity, constraint_mask, partition, alive)
        return i

    def _fill(
        self,
        i: int,
        node_id: str,
        address: str,
        capacity: np.ndarray,
        constraint_mask: int,
        partition: int,
        alive: bool,
    ) -> None:
        """Overwrite row ``i`` whole (``add``, into a vacant row or a new one; ``vacate``)."""
        self.node_ids[i] = node_id
        self.addresses[i] = address
        if node_id:
            self._index_of[node_id] = i
        self._capacity[:, i] = capacity
        self._free[:, i] = capacity
        self.has_cpu[i] = bool(capacity[CPU] > 0)
        self._usage_mean[i] = 0.0
        self._usage_var[i] = 0.0
        self._masks[i] = constraint_mask
        self._owner[i] = partition
        self.alive[i] = alive
        for c, bits in enumerate(self.constraint_bits):
            bits[i] = (constraint_mask >> c) & 1
        for p, bits in enumerate(self.members):
            bits[i] = p == partition

    def vacate(self, index: int) -> None:
        """Empty row ``index``: its node is forgotten (its id is free to register again,
        maybe into another row), and the row, dead and holding nothing, waits for the next
        new node. The caller makes sure nothing is booked on it."""
        if not 0 <= index < self.size:
            raise IndexError(f"no node with index {index}")
        node_id = self.node_ids[index]
        if self._index_of.get(node_id) == index:
            del self._index_of[node_id]
        self.version += 1
        self.static_version += 1
        zero = np.zeros(NUM_RESOURCES, dtype=np.int64)
        self._fill(index, "", "", zero, 0, int(self._owner[index]), False)
        self.vacant.add(index)

    def set_alive(self, index: int, alive: bool) -> None:
        self.alive[index] = alive
        self.version += 1

    def set_columns(self, columns: NodeColumns) -> None:
        """Overwrite (or append) the static facts of the given rows, vectorised."""
        if len(columns) == 0:
            return
        self.version += 1
        self.static_version += 1
        idx = columns.indices.astype(np.int64)
        new_size = max(self.size, int(idx.max()) + 1)
        if new_size > self.size:
            self._grow(new_size)
            grow_by = new_size - self.size
            self.node_ids.extend([""] * grow_by)
            self.addresses.extend([""] * grow_by)
            self._capacity[:, self.size : new_size] = 0
            self._free[:, self.size : new_size] = 0
            self._usage_mean[self.size : new_size] = 0.0
            self._usage_var[self.size : new_size] = 0.0
            self._masks[self.size : new_size] = 0
            self._owner[self.size : new_size] = 0
            self.vacant.update(range(self.size, new_size))  # until a column names a node
            self.size = new_size
        rows = zip(idx.tolist(), columns.node_ids, columns.addresses, strict=True)
        for i, node_id, address in rows:
            old = self.node_ids[i]
            if old and self._index_of.get(old) == i:
                del self._index_of[old]
            self.node_ids[i] = node_id
            self.addresses[i] = address
            if node_id:
                self._index_of[node_id] = i
                self.vacant.discard(i)
            else:  # a row the LM vacated (a forgotten node)
                self.vacant.add(i)
        self._capacity[:, idx] = columns.capacity
        self._masks[idx] = columns.constraint_masks
        self._owner[idx] = np.clip(columns.partitions, 0, self.num_partitions - 1)
        alive_all = np.zeros(self.size, dtype=bool)
        alive_all[: len(self.alive)] = bools_from_bits(self.alive)
        alive_all[idx] = columns.alive
        self._rebuild_bits(alive_all)
        self.has_cpu = bits_from_bools(self.free[CPU] > 0)

    def set_free(
        self,
        indices: np.ndarray,
        free: np.ndarray,
        usage_mean: np.ndarray | None = None,
        usage_var: np.ndarray | None = None,
    ) -> None:
        """Overwrite free resources of ``indices`` with ``free`` (NUM_RESOURCES, k) and
        their usage sums with ``usage_mean`` / ``usage_var`` (k,).

        Without usage sums (a sender that does not report them) they are derived as if
        no task had a usage estimate: mean = capacity - free cpu, variance 0. Capacity
        must be set first (``set_columns``).
        """
        idx = indices if indices.dtype == np.int64 else indices.astype(np.int64)
        self.version += 1
        self._free[:, idx] = free
        if 8 * len(idx) < self.size or len(idx) <= _FEW_ROWS:
            # A delta names a few rows of the table: only theirs change (rebuilding the
            # whole bitarray was a tenth of a 10,000-worker simulation, issue 29).
            has_cpu = self.has_cpu
            for i, cpu in zip(idx.tolist(), (free[CPU] > 0).tolist(), strict=True):
                has_cpu[i] = cpu
        else:
            self.has_cpu = bits_from_bools(self._free[CPU, : self.size] > 0)
        if usage_mean is None:
            usage_mean = (self._capacity[CPU, idx] - self._free[CPU, idx]).astype(np.float64)
        if usage_var is None:
            usage_var = np.zeros(len(idx), dtype=np.float64)
        self._usage_mean[idx] = usage_mean
        self._usage_var[idx] = usage_var

    def take(self, node: int, resources: np.ndarray, usage_mean: float, usage_var: float) -> None:
        """A task starts on ``node``: its resources leave ``free``, its usage joins the sums."""
        self.version += 1
        self._free[:, node] -= resources
        self.has_cpu[node] = bool(self._free[CPU, node] > 0)
        self._usage_mean[node] += usage_mean
        self._usage_var[node] += usage_var

    def give_back(
        self, node: int, resources: np.ndarray, usage_mean: float, usage_var: float
    ) -> None:
        """The inverse of ``take``: a task on ``node`` ended."""
        self.version += 1
        self._free[:, node] += resources
        self.has_cpu[node] = bool(self._free[CPU, node] > 0)
        self._usage_mean[node] -= usage_mean
        self._usage_var[node] -= usage_var

    # ------------------------------------------------------------- helpers
    def partition_free(self) -> np.ndarray:
        """Free resources summed per owner partition: (num_partitions, NUM_RESOURCES).

        A node booked past its capacity counts as full, not below it: in a GM's view that
        happens for a moment when two GMs book the same room (the LM refuses one), and a
        negative sum would take the deficit out of other nodes' real room.
        """
        out = np.zeros((self.num_partitions, NUM_RESOURCES), dtype=np.int64)
        np.add.at(out, self.owner, np.maximum(self.free, 0).T)
        return out

    def partition_sizes(self) -> np.ndarray:
        """Nodes per owner partition (vacant rows are no nodes)."""
        return np.bincount(self.owner[self.occupied()], minlength=self.num_partitions)

    def _rebuild_bits(self, alive: np.ndarray) -> None:
        self.alive = bits_from_bools(alive)
        masks = self.constraint_masks
        one = np.uint64(1)
        self.constraint_bits = [
            bits_from_bools((masks >> np.uint64(c)) & one) for c in range(self.num_constraints)
        ]
        owner = self.owner
        self.members = [bits_from_bools(owner == p) for p in range(self.num_partitions)]

    def _grow(self, needed: int) -> None:
        cap = self._free.shape[1]
        if needed <= cap:
            return
        while cap < needed:
            cap *= 2
        for name in ("_capacity", "_free"):
            old = getattr(self, name)
            new = np.zeros((NUM_RESOURCES, cap), dtype=np.int64)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)
        for name in ("_usage_mean", "_usage_var", "_masks", "_owner"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def columns(self, indices: Sequence[int] | np.ndarray | None = None) -> NodeColumns:
        """Static facts of ``indices`` (all rows when None), for a snapshot."""
        idx = np.arange(self.size) if indices is None else np.asarray(indices, dtype=np.int64)
        if not len(idx):  # most deltas change no node's static facts
            alive = np.zeros(0, dtype=bool)
        elif len(idx) <= _FEW_ROWS:
            alive = np.array([self.alive[i] for i in idx.tolist()], dtype=bool)
        else:
            alive = bools_from_bits(self.alive)[idx]
        return NodeColumns(
            indices=idx.astype(np.uint32),
            node_ids=[self.node_ids[i] for i in idx.tolist()],
            addresses=[self.addresses[i] for i in idx.tolist()],
            capacity=self._capacity[:, idx].copy(),
            constraint_masks=self._masks[idx].copy(),
            partitions=self._owner[idx].copy(),
            alive=alive,
        )
