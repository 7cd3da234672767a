"""What a simulation run models: the cluster, the schedulers, and the costs of each step.

Defaults follow the public simulators the paper compares against, so numbers line up:
0.5 ms per message (the Sparrow simulator's ``NETWORK_DELAY``, reused by the public Megha
simulator), a 10 s LM heartbeat (the paper), one CPU per worker and per task (both public
simulators). Processing costs are constants measured on the core (see ``docs/results.md``):
they keep a run deterministic, which measured CPU time would not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loadgen.queues import QueueFileError, check_gms
from services.common.config import QueueConfig
from services.core.contention import BACKLOG_INTERVAL_S, CLAIMS, OWNER_GRACE_S
from services.core.reservations import DEFAULT_TTL_S, TTL_MAX_S, TTL_MIN_S
from services.core.scheduler import MAX_REJECTIONS, ROUND_PER_QUEUE
from services.core.vdc import Vdc, VdcError

SCHEDULERS = ("megha", "sparrow", "central")
FINISH_NOTIFY = ("all", "owner", "none")

# The scheduler core takes up to this many tasks from a queue per scheduling round and
# gives up on a task the LMs rejected this often until the view changes.
LIVE_ROUND_PER_QUEUE = ROUND_PER_QUEUE
LIVE_MAX_REJECTIONS = MAX_REJECTIONS


class SimConfigError(ValueError):
    """A simulation parameter is out of range; the message says which and why."""


@dataclass(frozen=True)
class SimConfig:
    scheduler: str = "megha"
    """``megha`` (G GMs x L LMs), ``sparrow`` (batch sampling, late binding) or ``central``
    (the Megha code path with 1 GM x 1 LM over every worker)."""
    workers: int = 10_000
    """Worker nodes; split evenly over the LMs, each LM's nodes evenly over the GMs."""
    gms: int = 10
    """Global Masters (Megha); each serves one user queue and jobs go round-robin."""
    lms: int = 10
    """Local Masters (Megha)."""
    cores_per_worker: int = 1
    """CPUs per worker; a ``.tr`` task asks for one CPU."""
    memory_per_worker_mb: int = 4096
    """Memory per worker; ``.tr`` tasks ask for none, but a node needs some."""
    network_delay_s: float = 0.0005
    """One-way delay of every message (GM-LM, LM-worker, probes, heartbeats)."""
    heartbeat_interval_s: float = 10.0
    """How often each LM sends its delta state to every GM."""
    gm_match_s: float = 7e-6
    """GM time per match (one ``GlobalView.match``); ``megha bench match`` p50."""
    lm_validate_s: float = 9e-6
    """LM time per request it validates (``ClusterState.launch``), measured p50."""
    round_size: int = LIVE_ROUND_PER_QUEUE
    """Most tasks a GM places per scheduling round; one message per LM per round."""
    max_rejections: int = LIVE_MAX_REJECTIONS
    """Rejections after which a task waits for a view change instead of retrying."""
    finish_notify: str = "all"
    """Who learns of a finished task before the next heartbeat: ``all`` GMs (the live
    services' lifecycle events), the ``owner`` GM (the public Megha simulator), ``none``."""
    fair_share: bool = False
    """Paper Alg. 2: a GM whose user is under its share may preempt over-share users.
    Off by default: ``.tr`` traces have no users and the compared simulators no preemption."""
    queues: tuple[QueueConfig, ...] = ()
    """User queues (name, share, serving GM, ``--queues FILE``); tasks go to the GM that
    serves their queue. Empty: one queue per GM with equal shares, jobs round-robin."""
    probe_ratio: float = 2.0
    """Sparrow: probes per task."""
    lm_delta_history: int = 100_000
    """Ended tasks an LM remembers for delta snapshots (``ClusterState(delta_history=)``,
    the live LM's default); a GM further behind gets a full snapshot."""
    policy: str = "first-fit"
    """Placement policy of GM and LM (``services.core.match.POLICIES``)."""
    owner_grace_s: float = OWNER_GRACE_S
    """Room freed on a GM's partition is left to that GM this long before others
    repartition onto it (``services.core.contention.OwnerFirst``; 0: no such rule)."""
    claims: str = "oldest"
    """Who has the first claim on room an end freed (``services.core.contention.CLAIMS``):
    the GM whose work waited ``oldest`` (``OldestFirst``: every GM reports its backlog to
    all every ``backlog_interval_s``; the live GM's default too), or the node's ``owner``
    (``OwnerFirst``)."""
    backlog_interval_s: float = BACKLOG_INTERVAL_S
    """How often each GM reports its waiting work to every GM (``claims: oldest``), as
    the live GM's ``backlog_interval_s``: its own message, not the LMs' heartbeat."""
    preemption_slack: float = 0.0
    """Alg. 2: a queue preempts only when more than this below its share (0.01 = 1 pp)."""
    arrival_scale: float = 1.0
    """Multiplies every job's arrival time since the first (0.5: arrivals compressed into
    half the span, so the same trace loads the cluster twice as hard)."""
    seed: int = 0
    """Seeds the generator behind every random choice (heartbeat phases, Sparrow probes)."""
    uplink_mbps: int = 0
    """Each worker's uplink, its ``net_mbps`` capacity (0: none, so a task asking for
    network never fits; ``--gridiron`` tasks do)."""
    gangs: bool = False
    """Every job is a gang (issue 33): planned whole by ``services.core.gang.plan_gang``,
    reserved on its LMs and committed only when every LM holds its part; it never runs
    in part. Megha and central only. With fair share a gang is never a victim, and a
    waiting gang preempts as one unit (``Scheduler.gang_evictions``) tasks of a queue
    over its share: give ``gang_queues`` then, or there is nothing to preempt."""
    gang_queues: tuple[str, ...] = ()
    """With ``gangs``: only these user queues' jobs are gangs (the others' tasks are
    placed one by one); empty: every job. A job whose trace names no user goes task by
    task over the queues: it is a gang when its first task's queue is one of these, and
    other jobs' tasks in such a queue still run one by one."""
    vdc: tuple[float, float] | None = None
    """With ``gangs``: every job is a Gridiron VDC of (bandwidth per core, vlink cap),
    Mbit/s, whose vlinks must fit the workers' uplinks (``services.core.vdc``)."""
    peak_vdc: int = 0
    """With ``vdc``: a job of more tasks is split into VDCs of at most this many, in task
    order (as ``--gridiron`` splits it), each its own gang; 0: one VDC per job."""
    gang_ttl_s: float = DEFAULT_TTL_S
    """How long an LM holds a gang's reservation for its commit (``Reservations``), within
    the live LM's bounds (``TTL_MIN_S`` to ``TTL_MAX_S``)."""

    def effective(self) -> SimConfig:
        """``central`` is Megha with one GM and one LM: the counts the run really uses."""
        if self.scheduler == "central":
            # The one GM serves every user queue.
            queues = tuple(q.model_copy(update={"gm": "gm-1"}) for q in self.queues)
            return replace(self, gms=1, lms=1, queues=queues)
        return self

    def check(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise SimConfigError(f"unknown scheduler {self.scheduler!r}; use one of {SCHEDULERS}")
        if not 0 <= self.preemption_slack < 1:
            raise SimConfigError(f"preemption_slack must be in [0, 1), got {self.preemption_slack}")
        if self.claims not in CLAIMS:
            raise SimConfigError(f"claims must be one of {CLAIMS}, got {self.claims!r}")
        if self.finish_notify not in FINISH_NOTIFY:
            raise SimConfigError(f"finish_notify must be one of {FINISH_NOTIFY}")
        for name in ("workers", "gms", "lms", "cores_per_worker", "memory_per_worker_mb"):
            if getattr(self, name) < 1:
                raise SimConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("round_size", "max_rejections", "lm_delta_history"):
            if getattr(self, name) < 1:
                raise SimConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("network_delay_s", "gm_match_s", "lm_validate_s", "owner_grace_s"):
            if getattr(self, name) < 0:
                raise SimConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("heartbeat_interval_s", "backlog_interval_s"):
            if not getattr(self, name) > 0:
                raise SimConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.probe_ratio <= 0:
            raise SimConfigError("probe_ratio must be positive")
        if not self.arrival_scale > 0:
            raise SimConfigError(f"arrival_scale must be positive, got {self.arrival_scale}")
        if self.queues:
            if self.scheduler == "sparrow":
                raise SimConfigError("the sparrow model has no user queues")
            run = self.effective()  # central moves every queue onto its one GM
            try:
                check_gms(run.queues, run.gms)
            except QueueFileError as err:
                raise SimConfigError(str(err)) from None
        if self.uplink_mbps < 0:
            raise SimConfigError(f"uplink_mbps must not be negative, got {self.uplink_mbps}")
        if self.gangs and self.scheduler == "sparrow":
            raise SimConfigError("the sparrow model has no gangs")
        if self.gang_queues and not self.gangs:
            raise SimConfigError("gang_queues names the queues whose jobs are gangs: set gangs")
        unknown = sorted(set(self.gang_queues) - {q.name for q in self.queues})
        if unknown:
            raise SimConfigError(f"gang_queues names queues not configured: {unknown}")
        if self.vdc is not None and not self.gangs:
            raise SimConfigError("a VDC is a gang: set gangs as well")
        if self.peak_vdc < 0:
            raise SimConfigError(f"peak_vdc must not be negative, got {self.peak_vdc}")
        if self.vdc is not None:
            try:
                Vdc(*self.vdc)
            except VdcError as err:
                raise SimConfigError(f"vdc: {err}") from None
        if not TTL_MIN_S <= self.gang_ttl_s <= TTL_MAX_S:
            raise SimConfigError(
                f"gang_ttl_s must be within the LM's bounds {TTL_MIN_S:g}-{TTL_MAX_S:g} s, "
                f"got {self.gang_ttl_s}"
            )
        if not self.gang_ttl_s > 4 * self.network_delay_s:
            raise SimConfigError(
                f"gang_ttl_s must exceed a reserve/commit round trip, got {self.gang_ttl_s}"
            )
        if self.scheduler == "megha" and self.lms > self.workers:
            raise SimConfigError(
                f"{self.lms} LMs need at least as many workers, got {self.workers}"
            )


def ns(seconds: float) -> int:
    """Virtual time is integer nanoseconds, so modelled delays add up exactly."""
    return round(seconds * 1e9)
