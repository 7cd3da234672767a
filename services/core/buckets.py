"""Resource buckets: task demand as counts of node shapes, after the predictive autoscaler
for elastic batch jobs (Gao, 2020, Alg. 1-2).

    task vectors (N, R) ──Alg. 2: first bucket, in increasing Alg. 1 order, that holds it──▶
        bucket per task ──sum per bucket and dimension──▶ (B, R) ──ceil(sum / shape), max──▶
        counts (B,): nodes of each shape the demand needs

A bucket is a node shape (a resource vector). Alg. 1 orders resource vectors
lexicographically with the dimensions taken most expensive first (``cost_order``, default
cpu, memory, disk, network): a shape with fewer cores is cheaper whatever its memory.
Alg. 2 embeds each task into the cheapest shape that holds it in every dimension (first
fit over the shapes in increasing order). A task larger than every shape (an elastic job
spread over several nodes) goes to the shape that needs the fewest copies of itself,
``units = max_d ceil(task_d / shape_d)``; a task asking for a dimension no shape offers
fits nowhere and is reported, not dropped silently.

Counts assume ideal placement, as the paper does: the tasks embedded into one shape are
packed fluidly, so the count is ``max_d ceil(sum of the tasks' d / shape_d)``, counts
rounded up. Integer arithmetic throughout, so a count is never off by a rounding error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.core.resources import NUM_RESOURCES, RESOURCE_NAMES

# Most expensive dimension first: cores cost more than memory, memory more than disk.
DEFAULT_COST_ORDER: tuple[int, ...] = tuple(range(NUM_RESOURCES))
UNFIT = -1  # bucket index of a task no shape can hold


class BucketError(ValueError):
    """Bucket shapes or task vectors that cannot be embedded; the message says why."""


def _check_order(cost_order: Sequence[int], dims: int) -> np.ndarray:
    order = np.asarray(cost_order, dtype=np.intp)
    if sorted(order.tolist()) != list(range(dims)):
        raise BucketError(f"cost_order must be a permutation of 0..{dims - 1}, got {cost_order}")
    return order


def _as_vectors(vectors: np.ndarray | Sequence[Sequence[int]], what: str) -> np.ndarray:
    out = np.asarray(vectors, dtype=np.int64)
    if out.ndim != 2:
        raise BucketError(f"{what} must be a 2-d array (rows of resource vectors)")
    if np.any(out < 0):
        row = int(np.argwhere(out < 0)[0, 0])
        raise BucketError(f"{what} row {row} has a negative quantity: {out[row].tolist()}")
    return out


def compare(
    a: Sequence[int], b: Sequence[int], cost_order: Sequence[int] = DEFAULT_COST_ORDER
) -> int:
    """Alg. 1: -1, 0 or 1 as ``a`` is cheaper than, as costly as, or costlier than ``b``;
    the first dimension (in ``cost_order``) where they differ decides."""
    order = _check_order(cost_order, len(a))
    x, y = np.asarray(a)[order], np.asarray(b)[order]
    differ = np.flatnonzero(x != y)
    if differ.size == 0:
        return 0
    first = differ[0]
    return -1 if x[first] < y[first] else 1


def increasing_order(
    vectors: np.ndarray, cost_order: Sequence[int] = DEFAULT_COST_ORDER
) -> np.ndarray:
    """Indices that sort ``vectors`` (rows) cheapest first by Alg. 1; stable for ties."""
    vectors = np.asarray(vectors)
    order = _check_order(cost_order, vectors.shape[1])
    # np.lexsort sorts by its last key first, so the costliest dimension goes last.
    return np.lexsort(tuple(vectors[:, d] for d in order[::-1]))


@dataclass(frozen=True)
class Embedding:
    """Alg. 2's answer for a set of tasks.

    ``bucket[i]`` is the index (into the caller's bucket list) task i was embedded into,
    ``UNFIT`` when no shape can hold it; ``units[i]`` how many nodes of that shape it
    spans (1 unless it is larger than every shape; 0 when unfit); ``counts[b]`` the nodes
    of shape b the embedded tasks need, rounded up.
    """

    bucket: np.ndarray
    units: np.ndarray
    counts: np.ndarray

    @property
    def unfit(self) -> np.ndarray:
        """Indices of the tasks no bucket can hold."""
        return np.flatnonzero(self.bucket == UNFIT)


def assign_buckets(
    tasks: np.ndarray | Sequence[Sequence[int]],
    buckets: np.ndarray | Sequence[Sequence[int]],
    cost_order: Sequence[int] = DEFAULT_COST_ORDER,
) -> tuple[np.ndarray, np.ndarray]:
    """Alg. 2, vectorised over tasks: (bucket index per task, units per task).

    The cheapest shape (Alg. 1 order) holding the task in every dimension; failing that,
    the shape needing the fewest units (ties: the cheaper); failing that ``UNFIT``.
    """
    tasks = _as_vectors(tasks, "tasks")
    shapes = _as_vectors(buckets, "buckets")
    if shapes.shape[0] == 0:
        raise BucketError("need at least one bucket")
    if tasks.shape[1] != shapes.shape[1]:
        raise BucketError(
            f"tasks have {tasks.shape[1]} dimensions but buckets have {shapes.shape[1]}"
        )
    if np.any(shapes.sum(axis=1) == 0):
        raise BucketError("a bucket with every quantity zero holds nothing")
    rank = increasing_order(shapes, cost_order)  # position -> caller's index
    ordered = shapes[rank]
    if tasks.shape[0] == 0:
        return np.empty(0, dtype=np.intp), np.empty(0, dtype=np.int64)
    holds = np.all(tasks[:, None, :] <= ordered[None, :, :], axis=2)  # (N, B)
    fits_one = holds.any(axis=1)
    position = np.argmax(holds, axis=1)  # first True = cheapest shape that holds it
    units = np.ones(tasks.shape[0], dtype=np.int64)

    big = np.flatnonzero(~fits_one)
    if big.size:
        need = tasks[big][:, None, :]  # (n, 1, R)
        cap = ordered[None, :, :]
        never = np.iinfo(np.int64).max  # the shape lacks a dimension the task needs
        per_dim = np.where(cap == 0, never, -(-need // np.maximum(cap, 1)))
        per_dim = np.where(need == 0, 0, per_dim)
        copies = per_dim.max(axis=2)  # (n, B)
        best = np.argmin(copies, axis=1)  # argmin takes the first: the cheaper on ties
        best_units = copies[np.arange(big.size), best]
        possible = best_units < never
        position[big] = best
        units[big] = np.where(possible, best_units, 0)
        fits_one[big[possible]] = True

    bucket = np.where(fits_one, rank[position], UNFIT).astype(np.intp)
    units[~fits_one] = 0
    return bucket, units


def demand_sums(tasks: np.ndarray, bucket: np.ndarray, num_buckets: int) -> np.ndarray:
    """(B, R) summed task vectors per bucket; unfit tasks are left out."""
    tasks = np.asarray(tasks, dtype=np.int64)
    sums = np.zeros((num_buckets, tasks.shape[1]), dtype=np.int64)
    placed = bucket != UNFIT
    np.add.at(sums, bucket[placed], tasks[placed])
    return sums


def counts_from_sums(sums: np.ndarray, buckets: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
    """Nodes of each shape for summed demand, ``max_d ceil(sum_d / shape_d)``.

    ``sums`` is (..., B, R), e.g. (intervals, buckets, resources) for a whole series;
    the answer is (..., B). A dimension a shape does not offer holds no demand (Alg. 2
    never puts any there), so it counts 0.
    """
    shapes = np.asarray(buckets, dtype=np.int64)
    sums = np.asarray(sums, dtype=np.int64)
    if sums.shape[-2:] != shapes.shape:
        raise BucketError(f"sums of shape {sums.shape} do not match buckets {shapes.shape}")
    nodes = -(-sums // np.maximum(shapes, 1))  # ceil division in integers
    nodes = np.where(shapes == 0, 0, nodes)
    return nodes.max(axis=-1)


def embed(
    tasks: np.ndarray | Sequence[Sequence[int]],
    buckets: np.ndarray | Sequence[Sequence[int]],
    cost_order: Sequence[int] = DEFAULT_COST_ORDER,
) -> Embedding:
    """Alg. 2 and the counts: the nodes of each shape that ``tasks`` (running or pending
    together) need under ideal placement."""
    shapes = _as_vectors(buckets, "buckets")
    tasks_arr = np.asarray(tasks, dtype=np.int64)
    if tasks_arr.size == 0:
        tasks_arr = tasks_arr.reshape(0, shapes.shape[1])
    bucket, units = assign_buckets(tasks_arr, shapes, cost_order)
    counts = counts_from_sums(demand_sums(tasks_arr, bucket, len(shapes)), shapes)
    return Embedding(bucket=bucket, units=units, counts=counts)


def describe_unfit(task: Sequence[int], buckets: np.ndarray | Sequence[Sequence[int]]) -> str:
    """Why no bucket holds ``task``: the dimensions it asks for that no shape offers."""
    shapes = np.asarray(buckets)
    missing = [
        f"{RESOURCE_NAMES[d] if len(task) == NUM_RESOURCES else f'dimension {d}'}={task[d]}"
        for d in range(len(task))
        if task[d] > 0 and not np.any(shapes[:, d] > 0)
    ]
    return f"task asks for {', '.join(missing)} but no bucket offers it"
