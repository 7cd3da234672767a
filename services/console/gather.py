"""What each console page shows, asked of the GMs and LMs over their gRPC APIs.

    Sources.federation ──every LM: GetState + DrainNode(query); every GM: GetClusterView──▶
        LMs with their nodes (alive/dead/draining, free of total), partitions per GM,
        each GM's heartbeat age of each LM
    Sources.queues ──a GM's GetClusterView + each queue's pending at its own GM──▶ queues
    Sources.jobs / job / output ──every GM: ListJobs / GetJob / GetTaskOutput──▶ jobs
    Sources.allocations ──every GM: GetClusterView(allocation_samples)──▶ histogram, CDF

Every answer is a record of JSON types (``services.common.reports``): the HTML pages
render it and ``/api/...`` returns it as it is. A service that does not answer is named
in the record (``error``) and the rest is still shown. Answers are kept for ``ttl_s``, so
that any number of open pages costs the GMs what one does.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import grpc

from services.common.client import STATE_NAMES, GlobalMasterClient
from services.common.config import FederationConfig
from services.common.nodes import lm_nodes, node_rows
from services.common.reports import (
    Record,
    job_record,
    job_summary_record,
    pending_by_serving_gm,
    status_record,
)

CALL_TIMEOUT_S = 3.0  # a page waits at most this long for a service before naming it
TASK_STATES = tuple(name for number, name in sorted(STATE_NAMES.items()) if number)
# Histogram buckets of the allocation-time page: those of
# megha_allocation_duration_seconds (100 us .. ~100 s, x2 each), so page and dashboard agree.
BUCKETS_S = tuple(0.0001 * 2**i for i in range(21))
CDF_POINTS = 100  # points of a CDF curve
OUTPUT_TAIL_BYTES = 64 * 1024  # the job page shows the end of a task's output


class NotFound(LookupError):
    """A job (or task) no GM knows."""


def _error(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    if isinstance(err, TimeoutError):
        return "did not answer in time"
    return repr(err)


class Sources:
    """The console's view of one federation (its config): one GM client per GM, kept
    open, and a short-lived cache of answers."""

    def __init__(self, config: FederationConfig, ttl_s: float = 1.0):
        self.config = config
        self.ttl_s = ttl_s
        self.gms = {gm.id: GlobalMasterClient(gm.target) for gm in config.gms}
        self._cache: dict[tuple, tuple[float, asyncio.Future]] = {}

    async def close(self) -> None:
        for client in self.gms.values():
            await client.close()

    async def _cached(self, key: tuple, make: Callable[[], Awaitable[Any]]) -> Any:
        """``make()``'s answer, shared by every caller within ``ttl_s`` (one call for
        those who ask while it is under way, too)."""
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self.ttl_s:
            return await asyncio.shield(hit[1])
        future = asyncio.ensure_future(make())
        self._cache[key] = (now, future)
        if len(self._cache) > 256:  # job pages of many jobs: drop the stale ones
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.ttl_s}
        return await asyncio.shield(future)

    async def _each_gm(self, call: Callable[[GlobalMasterClient], Awaitable[Any]]):
        """(gm_id, answer or None, error or "") of every GM, asked at once."""

        async def one(gm_id: str, client: GlobalMasterClient):
            try:
                return gm_id, await asyncio.wait_for(call(client), CALL_TIMEOUT_S), ""
            except (grpc.aio.AioRpcError, TimeoutError) as err:
                return gm_id, None, _error(err)

        return await asyncio.gather(*(one(g, c) for g, c in self.gms.items()))

    # ---------------------------------------------------------------- federation
    async def federation(self) -> Record:
        return await self._cached(("federation",), self._federation)

    async def _federation(self) -> Record:
        views, states = await asyncio.gather(
            self._each_gm(lambda c: c.cluster(timeout_s=CALL_TIMEOUT_S)),
            asyncio.gather(
                *(asyncio.wait_for(lm_nodes(lm.target), CALL_TIMEOUT_S) for lm in self.config.lms),
                return_exceptions=True,
            ),
        )
        gms = []
        seen: dict[str, dict[str, Any]] = {}  # lm -> gm -> what that GM believes
        for gm_id, view, error in views:
            gms.append({"gm_id": gm_id, "target": self.config.gm(gm_id).target, "error": error})
            for lm in view.lms if view is not None else ():
                seen.setdefault(lm.lm_id, {})[gm_id] = {
                    "age_s": round(lm.age_s, 3),
                    "silent": lm.silent,
                    "version": lm.version,
                }
        lms = []
        for lm, answer in zip(self.config.lms, states, strict=True):
            record: Record = {
                "lm_id": lm.id,
                "target": lm.target,
                "error": "",
                "heartbeats": seen.get(lm.id, {}),
                "nodes": [],
                "partitions": [],
            }
            if isinstance(answer, BaseException):
                record["error"] = _error(answer)
            else:
                state, draining = answer
                rows = sorted(node_rows(state, draining), key=lambda r: natural(r.node_id))
                record["version"] = state.version
                record["nodes"] = [asdict(r) for r in rows]
                record["partitions"] = _partitions(rows, list(state.gm_ids))
            record["counts"] = dict(Counter(n["state"] for n in record["nodes"]))
            lms.append(record)
        nodes = [n for lm in lms for n in lm["nodes"]]
        return {
            "gms": gms,
            "lms": lms,
            "nodes": len(nodes),
            "counts": dict(Counter(n["state"] for n in nodes)),
            "labels": {str(k): v for k, v in self.config.constraint_labels.items()},
        }

    # -------------------------------------------------------------------- queues
    async def queues(self) -> Record:
        return await self._cached(("queues",), self._queues)

    async def _queues(self) -> Record:
        errors = []
        for gm_id, client in self.gms.items():  # the first GM that answers
            try:
                view = await client.cluster(timeout_s=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                errors.append(f"{gm_id}: {_error(err)}")
                continue
            pending = await pending_by_serving_gm(view, self.config, client.target)
            record = status_record(view, pending, self.config, client.target)
            record["errors"] = errors
            return record
        return {"gm": "", "lms": [], "lms_not_heard_from": [], "queues": [], "errors": errors}

    # ---------------------------------------------------------------------- jobs
    async def jobs(self, queue: str = "", state: str = "", limit: int = 50) -> Record:
        """The jobs the GMs remember, newest first: each GM's list, merged by rank (its
        newest, then each one's second newest, ...) and a job that several GMs know
        (the one it was submitted through, the one serving its queue) shown once, as
        the GM that knows most of its tasks ended sees it. ``state``: only jobs with a
        task in that state (``unfinished``: one not ended)."""
        if state and state != "unfinished" and state not in TASK_STATES:
            raise ValueError(
                f"unknown state {state!r}; known: unfinished, {', '.join(TASK_STATES)}"
            )
        return await self._cached(
            ("jobs", queue, state, limit), lambda: self._jobs(queue, state, limit)
        )

    async def _jobs(self, queue: str, state: str, limit: int) -> Record:
        unfinished = state == "unfinished"
        # A state filter is applied here: ask for more so that enough remain.
        asked = limit if not state or unfinished else min(1000, limit * 4)
        answers = await self._each_gm(lambda c: c.jobs(queue, asked, unfinished))
        lists = [[job_summary_record(j) for j in jobs or ()] for _, jobs, _ in answers]
        merged: dict[str, Record] = {}
        for rank in range(max((len(x) for x in lists), default=0)):
            for listed in lists:
                if rank >= len(listed):
                    continue
                job = listed[rank]
                known = merged.get(job["job_id"])
                if known is None or _ended(job) > _ended(known):
                    merged[job["job_id"]] = job
        jobs = [j for j in merged.values() if not state or unfinished or state in j["states"]]
        jobs = jobs[:limit]
        counts: Counter[str] = Counter()
        for job in jobs:
            counts.update(job["states"])
        return {
            "jobs": jobs,
            "counts": dict(counts.most_common()),
            "errors": [f"{gm}: {error}" for gm, _, error in answers if error],
        }

    async def job(self, job_id: str) -> Record:
        return await self._cached(("job", job_id), lambda: self._job(job_id))

    async def _job(self, job_id: str) -> Record:
        answers = await self._each_gm(lambda c: c.job(job_id))
        found = [(gm, job) for gm, job, _ in answers if job is not None]
        if not found:
            errors = [e for _, _, e in answers if not e.startswith("NOT_FOUND")]
            raise NotFound(
                f"no GM knows job {job_id!r}" + (f" ({'; '.join(errors)})" if errors else "")
            )
        records = [(gm, job_record(job)) for gm, job in found]
        gm_id, record = max(records, key=lambda r: _ended(r[1]))
        record["gm_id"] = gm_id
        return record

    async def output(self, job_id: str, task_id: str, stderr: bool = False) -> Record:
        """The end of what a task's latest attempt wrote, read from its worker host."""
        record = await self.job(job_id)
        client = self.gms[record["gm_id"]]
        stream = "stderr" if stderr else "stdout"
        try:
            part = await client.output(job_id, task_id, None, stderr, -OUTPUT_TAIL_BYTES)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(err.details()) from None
            return {"stream": stream, "text": "", "note": err.details() or err.code().name}
        note = ""
        if not part.found:
            note = "no output kept for this attempt (a simulated task writes none)"
        elif part.offset > 0:
            note = f"the last {len(part.data)} of {part.size} bytes"
        return {
            "stream": stream,
            "attempt": part.attempt,
            "text": part.data.decode("utf-8", errors="replace"),
            "note": note,
            "running": part.running,
        }

    # --------------------------------------------------------------- allocations
    async def allocations(self) -> Record:
        return await self._cached(("allocations",), self._allocations)

    async def _allocations(self) -> Record:
        answers = await self._each_gm(
            lambda c: c.cluster(timeout_s=CALL_TIMEOUT_S, allocation_samples=True)
        )
        gms = []
        for gm_id, view, error in answers:
            samples = list(view.recent_allocation_times.samples_s) if view is not None else []
            gms.append({"gm_id": gm_id, "error": error, **distribution(samples)})
        return {"gms": gms, "buckets_s": list(BUCKETS_S)}


def natural(name: str) -> tuple:
    """Sorts ``lm-1-w10`` after ``lm-1-w9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _ended(job: Record) -> int:
    ended = ("succeeded", "failed", "rejected", "cancelled")
    return sum(job["states"].get(s, 0) for s in ended)


def _partitions(rows, gm_ids: list[str]) -> list[Record]:
    """Per GM partition of one LM: its nodes, alive ones, and free of total cpu/memory
    (alive nodes only: a dead node's room is no one's)."""
    out = []
    for gm_id in gm_ids:
        mine = [r for r in rows if r.gm_id == gm_id]
        alive = [r for r in mine if r.state != "dead"]
        out.append(
            {
                "gm_id": gm_id,
                "nodes": len(mine),
                "alive": sum(r.state == "alive" for r in mine),
                "draining": sum(r.state == "draining" for r in mine),
                "cpu_free_milli": sum(r.cpu_free_milli for r in alive),
                "cpu_milli": sum(r.cpu_milli for r in alive),
                "memory_free_mb": sum(r.memory_free_mb for r in alive),
                "memory_mb": sum(r.memory_mb for r in alive),
            }
        )
    return out


def distribution(samples: list[float]) -> Record:
    """Count, percentiles, a histogram over ``BUCKETS_S`` (the last bucket also holds
    what is above it) and a CDF of ``samples`` (seconds)."""
    if not samples:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "histogram": [], "cdf": []}
    ordered = sorted(samples)
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

    histogram = [0] * len(BUCKETS_S)
    for value in ordered:
        i = next((i for i, le in enumerate(BUCKETS_S) if value <= le), len(BUCKETS_S) - 1)
        histogram[i] += 1
    step = max(1, n // CDF_POINTS)
    cdf = [[ordered[i], (i + 1) / n] for i in range(step - 1, n, step)]
    if cdf[-1][1] < 1.0:
        cdf.append([ordered[-1], 1.0])
    return {
        "count": n,
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": ordered[-1],
        "histogram": histogram,
        "cdf": cdf,
    }
