"""The federation config: one file (YAML or TOML) every process reads, validated by pydantic.

Any top-level scalar can be overridden by an environment variable ``MEGHA_<NAME>``
(for example ``MEGHA_RABBITMQ_URL``, ``MEGHA_HEARTBEAT_INTERVAL_S``); containers use that
to point the same file at other hosts. Errors come out as one readable message
(``ConfigError``), never as a traceback.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, get_origin
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.core.cluster_state import ENDED_KEPT
from services.core.constraints import (
    CONSTRAINT_NAME,
    DEFAULT_NUM_CONSTRAINTS,
    MAX_CONSTRAINTS,
    ConstraintError,
    constraint_ids,
)
from services.core.contention import BACKLOG_INTERVAL_S, OWNER_GRACE_S
from services.core.fairness import QueueShare
from services.core.limits import parse_limit
from services.core.match import PlacementPolicy, make_policy
from services.core.resources import (
    DEFAULT_MAX_NODE_CAPACITY,
    ResourceError,
    above_bound,
    parse_bound,
    parse_resources,
)

# How long a worker agent keeps one heartbeat stream (services/worker/agent.py).
WORKER_STREAM_LIFE_S = 120.0

ENV_PREFIX = "MEGHA_"
# worker_run_as: empty, uid[:gid], or a user name (as useradd takes it).
_RUN_AS = re.compile(r"|\d+(:\d+)?|[A-Za-z_][A-Za-z0-9_.-]*\$?")


class ConfigError(ValueError):
    """The config file is missing, unreadable or invalid; the message says where and why."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Model):
    """Where a server is: ``host`` is what others dial (the advertised address), ``bind``
    what it listens on. They differ behind NAT or in a container (``bind: 0.0.0.0``, ``host``
    the name others resolve). The Prometheus port listens on every address."""

    host: str = Field("127.0.0.1", description="Address other services dial.")
    port: int = Field(..., ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 = none.")
    bind: str = Field("", description="Address to listen on (default: host).")

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def listen(self) -> str:
        return f"{self.bind or self.host}:{self.port}"


class GlobalMasterConfig(Endpoint):
    id: str = Field(..., min_length=1, description="Unique GM id; also its partition name.")


class LocalMasterConfig(Endpoint):
    id: str = Field(..., min_length=1, description="Unique LM id.")
    journal: str = Field(
        "",
        description="File where the LM keeps the tasks it accepted and the tasks that ended "
        "on it, so that after a restart it neither runs an ended task again nor forgets how "
        "it ended, and queues again what it had accepted and no worker still holds; empty = "
        "memory only.",
    )
    max_node_capacity: str = Field(
        "",
        description="This LM's bound on one node's advertised capacity, e.g. 'cpu=256,mem=2Ti': "
        "the resources it names replace the federation's max_node_capacity, the others "
        "keep it; empty = the federation's. A worker registering above it is refused.",
    )

    @field_validator("max_node_capacity")
    @classmethod
    def _bound_parses(cls, value: str) -> str:
        return _checked_bound(value)


class _Nodes(_Model):
    """Nodes of one shape on one LM: what worker groups and autoscale pools share."""

    lm: str = Field(..., description="Id of the LM the nodes register with.")
    capacity: str = Field("cpu=4,mem=8Gi,disk=50Gi,net=1G", description="Per node.")
    constraints: list[int] = Field(
        default_factory=list,
        description="Constraints each node has: ids, or names from constraint_names.",
    )
    executor: Literal["sim", "process", "docker"] = Field("sim", description="Default executor.")
    capacity_beyond_host: bool = Field(
        False,
        description="With a process or docker executor, each node advertises at most the "
        "CPUs and memory of the machine its host runs on (its CPU affinity, cgroup limits and "
        "physical memory), logging when it cuts capacity down; true: advertise capacity as "
        "written (to try out packing on a small machine). Sim nodes always advertise it.",
    )

    @field_validator("capacity")
    @classmethod
    def _capacity_parses(cls, value: str) -> str:
        try:
            parse_resources(value)
        except ResourceError as err:
            raise ValueError(f"capacity {value!r}: {err}") from None
        return value


class WorkerGroup(_Nodes):
    """Identical worker agents attached to one LM (one ``megha worker`` process)."""

    count: int = Field(8, ge=1, le=10_000, description="Agents (nodes) in the process.")
    name_prefix: str = Field("", description="Node id prefix; default '<lm>-w'.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 = none.")
    host: str = Field(
        "",
        description="Address of the machine the group runs on, as others reach it: each node "
        "advertises it to its LM (with ':<metrics_port>' when the group has one; megha nodes "
        "--json shows it). The environment variable MEGHA_ADVERTISE_HOST of the worker "
        "process takes its place (one federation file for every machine). Nothing dials a "
        "worker host (its agents dial their LM), so empty is fine: the nodes advertise none.",
    )


class AutoscalePool(_Nodes):
    """Nodes ``megha autoscale`` starts and stops on one LM, each a ``megha worker``
    process of one agent, between ``min`` and ``max`` of them."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Pool name.")
    name_prefix: str = Field("", description="Node id prefix; default '<lm>-<name>-'.")
    min: int = Field(0, ge=0, le=1000, description="Nodes kept even when idle.")
    max: int = Field(..., ge=1, le=1000, description="Nodes at most.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalePool:
        if self.min > self.max:
            raise ValueError(f"pool {self.name!r}: min {self.min} is above max {self.max}")
        return self

    @property
    def prefix(self) -> str:
        return self.name_prefix or f"{self.lm}-{self.name}-"

    def node_id(self, slot: int) -> str:
        return f"{self.prefix}{slot}"

    def group(self) -> WorkerGroup:
        """A one-agent worker group of the pool; its node in slot s is the group's
        host at index offset s."""
        return WorkerGroup(
            lm=self.lm,
            count=1,
            capacity=self.capacity,
            constraints=self.constraints,
            executor=self.executor,
            name_prefix=self.prefix,
            capacity_beyond_host=self.capacity_beyond_host,
        )


class AutoscaleConfig(_Model):
    """``megha autoscale``: grows pools of nodes ahead of demand (predictor forecast) and
    shrinks them when their nodes idle."""

    interval_s: float = Field(60.0, gt=0, le=86_400, description="One look and decision.")
    method: Literal["auto", "reactive", "seasonal", "gradient-boosted"] = Field(
        "auto",
        description="Forecast: auto = the best the history supports; reactive = demand now.",
    )
    idle_s: float = Field(300.0, ge=0, description="Idle this long, a node is drained.")
    state_dir: str = Field(
        "", description="History and started nodes, kept across restarts (default: temp dir)."
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 = none.")
    pools: list[AutoscalePool] = Field(..., min_length=1)


class QueueConfig(_Model):
    """A user queue: the one type for it outside ``services/core`` (federation files,
    ``megha-loadgen --queues FILE``, the simulator); the core's fairness decisions get
    ``as_share``."""

    name: str = Field(..., min_length=1, description="User queue name.")
    share: float = Field(1.0, gt=0, le=1, description="Dominant-resource share of the pool.")
    gm: str = Field(
        ...,
        description="The GM that serves this queue; with queue_failover, the one preferred "
        "(another serves it while this one is down).",
    )
    limit: str = Field(
        "",
        description="The most the queue may hold across the federation at any time, e.g. "
        "'cpu=16,mem=64Gi' (resources left out are unlimited; empty = no limit). Its tasks "
        "wait while it is reached, and a task asking for more is refused at submission.",
    )

    @field_validator("limit")
    @classmethod
    def _limit_parses(cls, value: str) -> str:
        if value.strip():
            try:
                parse_limit(value)
            except ResourceError as err:
                # Chained: a queue file's message names the reason alone (loadgen.queues).
                raise ValueError(f"limit {value!r}: {err}") from err
        return value

    def as_share(self) -> QueueShare:
        """The queue as the core's fairness decisions see it (which GM serves it is the
        drivers' business: ``FederationConfig.queues_of``)."""
        return QueueShare(self.name, self.share)


class TlsConfig(_Model):
    """Mutual TLS for every gRPC connection of the federation (servers, the channels
    between them, workers, the CLI): each side shows a certificate signed by ``ca`` and
    accepts only peers that do. An ``amqps://`` ``rabbitmq_url`` uses them for the
    broker too (unless its query names aiormq's own ``cafile``, ``certfile``, ...)."""

    ca: str = Field(..., min_length=1, description="PEM file of the CA that signs them all.")
    cert: str = Field("", description="PEM certificate this process shows (one for every process).")
    key: str = Field("", description="PEM private key of ``cert``.")
    dir: str = Field(
        "",
        description="Per-process identities instead of one certificate: each process shows "
        "``<dir>/<role>/<name>.crt`` and ``.key`` (``megha certs`` writes them), e.g. "
        "gm/gm-1, lm/lm-1, worker/lm-1 (the worker hosts of lm-1), user/alice, "
        "admin/operator. Servers read the caller's role and name from the certificate's "
        "URI, spiffe://megha/<role>/<name>.",
    )
    server_name: str = Field(
        "",
        description="The name to check in a server's certificate instead of the host of its "
        "target (e.g. one certificate for every process, issued for this name).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> TlsConfig:
        if not self.dir and not (self.cert and self.key):
            raise ValueError("tls needs cert and key, or dir (per-process identities)")
        return self


Right = Literal["submit", "cancel", "watch"]


class UserConfig(_Model):
    """What one user may do: per queue (``"*"``: every queue), ``submit`` jobs, ``cancel``
    their own jobs, ``watch`` jobs (GetJob, WatchJob, ListJobs, task output). An admin may
    do everything: any queue, anyone's jobs, drain nodes."""

    queues: dict[str, list[Right]] = Field(default_factory=dict)
    admin: bool = False
    token_sha256: str = Field(
        "",
        pattern=r"^([0-9a-f]{64})?$",
        description="SHA-256 (hex) of a bearer token the user may show instead of a "
        "certificate (``megha certs --token NAME`` makes one); the token itself is never "
        "stored.",
    )


class AuthzConfig(_Model):
    """Who may call what. Servers then check every call: roles (from the caller's
    certificate) against the RPCs each role may call, and users against their queues.
    Refused calls end PERMISSION_DENIED with the reason."""

    users: dict[str, UserConfig] = Field(default_factory=dict)
    roles: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Which roles may call an RPC, replacing the default for it (docs/"
        "security.md has the table), e.g. {LocalMaster/DrainNode: [autoscaler]}: the console "
        "may then not even query a drain. Admins may always call everything.",
    )
    audit: str = Field(
        "-",
        description="Where each process writes its audit log, one JSON line per "
        "state-changing or refused call: a file path ({process} is replaced by the "
        "process's identity, e.g. gm.gm-1), '-' for stdout, '' for none.",
    )

    @field_validator("roles")
    @classmethod
    def _known_rpcs_and_roles(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        from services.common.authz import ROLES, RPC_ROLES

        known = {m.removeprefix("/megha.v1.") for m in RPC_ROLES}
        for rpc, roles in value.items():
            if rpc not in known:
                raise ValueError(f"unknown RPC {rpc!r}; known: {', '.join(sorted(known))}")
            if bad := sorted(set(roles) - ROLES):
                raise ValueError(f"{rpc}: unknown roles {bad}; roles: {', '.join(sorted(ROLES))}")
        return value


BROKER_ROLES = ("gm", "lm", "reader")


class BrokerUser(_Model):
    """One RabbitMQ user: its name, and a file that holds its password (never the
    password itself, so the federation file can be shared and logged)."""

    name: str = Field(..., min_length=1, pattern=r"^[^\s:@/]+$", description="User name.")
    password_file: str = Field(
        ..., min_length=1, description="File whose content (less a final newline) is it."
    )


class BrokerConfig(_Model):
    """Who the federation's processes are on RabbitMQ (docs/security.md, "The broker").

    Each role connects as its own user instead of with ``rabbitmq_url``'s credentials;
    ``megha broker-users`` creates them with the permissions of their role on the vhost
    ``rabbitmq_url`` names. A role without a user here keeps the URL's credentials."""

    gm: BrokerUser | None = Field(None, description="GMs: the only readers of user queues.")
    lm: BrokerUser | None = Field(None, description="LMs: heartbeats, events, re-queues.")
    reader: BrokerUser | None = Field(
        None, description="Event watchers (the load generator): read events, nothing more."
    )
    queue_signing_key: str = Field(
        "",
        description="File of the key GMs and LMs sign work-queue messages with (HMAC-SHA256); "
        "a GM drops a message without a valid signature. Empty: unsigned, and every message "
        "a broker user can put in a user queue is scheduled (the insecure default).",
    )
    task_seal_key: str = Field(
        "",
        description="File of the key only GMs read: the GM that accepts a job seals each task "
        "(HMAC over what it runs and for whom) and a GM schedules from a queue only tasks "
        "whose seal holds, so an LM, which may re-queue tasks, cannot forge work. Empty: "
        "no seals.",
    )


def _named(items: list[Any], names: dict, what: str) -> list[Any]:
    """Worker groups or pools with constraint names turned into ids (``what`` formats
    with the item's fields, to say which one is wrong)."""
    out = []
    for item in items:
        listed = item.get("constraints") if isinstance(item, dict) else None
        if isinstance(listed, list):
            try:
                item = {**item, "constraints": constraint_ids(listed, names)}
            except ConstraintError as err:
                fields = {"lm": item.get("lm"), "name": item.get("name")}
                raise ValueError(f"{what.format(**fields)}: {err}") from None
        out.append(item)
    return out


class FederationConfig(_Model):
    rabbitmq_url: str = Field(
        "amqp://guest:guest@127.0.0.1:5672/",
        description="Broker URL, or the URLs of one RabbitMQ cluster's nodes separated by "
        "commas: a process connects to the first it reaches and, when that node goes away, "
        "to the next that answers (services.common.bus).",
    )
    queue_type: Literal["quorum", "classic"] = Field(
        "quorum",
        description="RabbitMQ queue type of the work queues (user queues, kept cancel "
        "queues): quorum queues are replicated across a cluster's nodes and survive losing a "
        "minority of them; classic keeps a broker's existing classic queues (a queue cannot "
        "change type: delete it, or set this to its type).",
    )
    queue_failover: bool = Field(
        False,
        description="Every GM consumes every user queue with RabbitMQ's single active "
        "consumer: the broker delivers a queue to one GM at a time (its queues[].gm, which "
        "subscribes first, unless that GM is down) and hands it to a standby GM when that "
        "one goes away; its unacked messages are redelivered there, checked against what "
        "the LMs launched. Costs the from-memory start of jobs submitted to their own GM "
        "(docs/failover.md). A queue cannot change this setting: delete it first.",
    )
    owner_grace_s: float = Field(
        OWNER_GRACE_S,
        ge=0,
        le=3600,
        description="Contention (issue 29, services/core/contention.py OwnerFirst): room "
        "freed on another GM's partition is left to that GM until a snapshot of the LM "
        "shows it, at most this long; 0 turns the rule off (every GM races for it).",
    )
    claims: Literal["owner", "oldest"] = Field(
        "oldest",
        description="Contention (issue 29, services/core/contention.py): who has the first "
        "claim on room a task's end frees: the GM whose work waited longest (OldestFirst, "
        "the default: every GM tells every GM its oldest waiting work every "
        "backlog_interval_s, so a full federation serves its GMs' work in arrival order, as "
        "one queue would, each queue within its share), or the node's owner GM "
        "(OwnerFirst). Holds last owner_grace_s at most.",
    )
    backlog_interval_s: float = Field(
        BACKLOG_INTERVAL_S,
        gt=0,
        le=60,
        description="claims: oldest: how often each GM tells every GM its waiting work. A "
        "burst younger than the last report is placed only as LMs' heartbeats show it room "
        "(docs/results.md, Contention: reports every 10 s cost the 7,500-worker sweep 1.46x "
        "central's p99, every 0.5-2 s at most 1.13x).",
    )
    preemption_slack: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Fairness (Alg. 2): a queue preempts only when it is more than this "
        "below its share (a fraction of the federation, dominant share: 0.01 = 1 pp). With "
        "claims: oldest, freed room goes to queues within their share first, so small "
        "deficits close without preempting (docs/results.md, Fairness: 0.01 cut the "
        "preemptions of the paper's run fivefold, shares within 1 pp).",
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60, description="LM state broadcast.")
    full_state_every: int = Field(10, ge=1, description="Every Nth heartbeat is a full state.")
    worker_heartbeat_interval_s: float = Field(
        2.0,
        gt=0,
        le=60,
        description="A worker agent idle this long sends a heartbeat (task reports go at once).",
    )
    worker_timeout_s: float = Field(10.0, gt=0, description="Silence before a worker is dead.")
    forget_lost_after_s: float = Field(
        600.0,
        ge=0,
        description="A node lost (dead) this long without registering again is forgotten: "
        "its LM drops it from its nodes, so GMs and megha nodes no longer list it (its worker, "
        "if it ever comes back, simply registers again). 0: lost nodes are listed for ever.",
    )
    max_node_capacity: str = Field(
        DEFAULT_MAX_NODE_CAPACITY,
        description="The most one node may advertise, e.g. 'cpu=1024,mem=16Ti,disk=1024Ti,"
        "net=1T' (the default; resources left out keep it): a worker registering above it "
        "is refused (INVALID_ARGUMENT), and worker groups and autoscale pools above it are "
        "a config error. Each LM may set its own (lms[].max_node_capacity).",
    )
    lm_call_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="A GM gives up waiting for an LM's answer to a launch, repartition or "
        "preemption after this long; it then fences the tasks on that LM (the LM refuses the "
        "request if it reads it later) before placing them again.",
    )
    worker_stream_life_s: float = Field(
        WORKER_STREAM_LIFE_S,
        gt=0,
        description="A worker agent replaces its heartbeat stream after about this long, "
        "without registering again: gRPC holds memory per message for a stream's whole life.",
    )
    worker_fence_s: float = Field(
        0.0,
        ge=0,
        description="A worker agent that has not heard from its LM for this long kills the "
        "tasks it runs (reported LOST), so that a worker cut off from its LM does not run them "
        "while the LM, after worker_timeout_s, runs them elsewhere. 0 (the default): never, "
        "and tasks also go on through an LM restart of any length. Otherwise at least twice "
        "worker_heartbeat_interval_s and at most worker_timeout_s - 1 (a kill must finish "
        "before the LM gives the task to another worker).",
    )
    worker_janitor: bool = Field(
        True,
        description="Each worker host starts a small janitor process that, when the host "
        "dies (kill -9, the OOM killer, a crash), at once kills what its process tasks "
        "started and removes its containers, instead of leaving them to the host's next "
        "start (or for ever, if it never starts again) while the LM runs those tasks "
        "elsewhere.",
    )
    worker_output_dir: str = Field(
        "",
        description="Where worker hosts keep what their tasks write to stdout and stderr, "
        "a directory per host (megha logs reads it back). Empty: megha-<uid>/output under "
        "the temp dir; megha up uses its log directory.",
    )
    worker_output_keep: int = Field(
        10_000,
        ge=1,
        description="How many task attempts' output each worker host keeps; the oldest "
        "are deleted as new attempts start.",
    )
    worker_output_max_mb: int = Field(
        64,
        ge=0,
        le=1 << 20,
        description="Each task attempt's stdout and its stderr each keep about their last "
        "this many MiB on the worker host (megha logs reads from the first byte kept); "
        "0: kept whole. Checked every 0.5 s while the task runs.",
    )
    worker_output_max_gb: float = Field(
        20,
        ge=0,
        description="Each worker host keeps at most this many GiB of ended attempts' "
        "output (the oldest are deleted first, as past worker_output_keep); 0: no limit. "
        "Attempts still running are not counted until they end.",
    )
    worker_memory_check_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="How often a worker host sums the resident memory of each process "
        "task's processes; a task over its memory request is killed and fails (a "
        "container is held to it by the engine). 0: process tasks are not held to it.",
    )
    worker_run_as: str = Field(
        "",
        description="Whom tasks run as: a user name of the worker host or uid[:gid]. Empty: "
        "a worker that runs as root runs process tasks as nobody (65534:65534), a worker "
        "that runs as another user runs them as itself (it cannot switch); containers run "
        "as 65534:65534 either way. A named user keeps its groups, a uid gets none. Root "
        "(uid or gid 0) is refused unless worker_allow_root_tasks is true.",
    )
    worker_allow_root_tasks: bool = Field(
        False,
        description="Allow worker_run_as to name root (uid or gid 0): tasks then run with "
        "every privilege of the worker host. Off by default: tasks never run as root.",
    )
    worker_task_max_processes: int = Field(
        4096,
        ge=0,
        description="The most processes and threads a task may have: each container's pids "
        "limit, and for process tasks run as another user than the worker's, that user's "
        "RLIMIT_NPROC (which counts all its processes on the host, of every task "
        "together). 0: no limit.",
    )
    event_batch_s: float = Field(
        0.05,
        ge=0,
        le=1,
        description="An LM gathers task lifecycle events this long into one message: fewer, "
        "larger messages for the broker and every subscriber (events are observations; "
        "no placement waits for them).",
    )
    gm_job_history_tasks: int = Field(
        500_000,
        ge=1_000,
        description="Tasks each GM remembers for GetJob and WatchJob (every GM hears of "
        "every task; about 0.23 KB each in memory); past it, the jobs heard of least recently "
        "are forgotten.",
    )
    lm_ended_kept: int = Field(
        ENDED_KEPT,
        ge=10_000,
        description="Ended attempts each LM remembers, in memory and in its journal (about "
        "0.14 KB each in memory, with their job): a retry of one of them is refused as a "
        "duplicate, and another job's task with its id as taken, so a GM that retries an "
        "attempt older than this may run it again.",
    )
    lm_endings_kept: int = Field(
        100_000,
        ge=1_000,
        description="Ended tasks whose whole final event each LM keeps (about 0.3 KB each), to "
        "tell a GM that missed the event how the task ended (LookupTasks, ListTasks).",
    )
    num_constraints: int = Field(DEFAULT_NUM_CONSTRAINTS, ge=1, le=MAX_CONSTRAINTS)
    policy: Literal["first-fit", "best-fit", "gpa"] = Field(
        "first-fit",
        description="Placement policy, the same in every GM and LM. gpa: CPU by the "
        "probabilistic GPA test (may oversubscribe CPU requests), the rest strict.",
    )
    gpa_rho: float = Field(
        0.01,
        gt=0,
        le=0.5,
        description="GPA's SLO: the largest accepted probability that a node's CPU usage "
        "exceeds its capacity (only read when policy is gpa).",
    )
    exchange_prefix: str = Field("megha", description="Namespace for exchanges and queues.")
    constraint_names: dict[str, int] = Field(
        default_factory=dict,
        description="Names for constraint ids, e.g. {ssd: 3, gpu: 7}: worker groups, job files "
        "and megha submit --constraints may then say ssd,gpu; reasons name them too.",
    )
    gms: list[GlobalMasterConfig] = Field(..., min_length=1)
    lms: list[LocalMasterConfig] = Field(..., min_length=1)
    workers: list[WorkerGroup] = Field(default_factory=list)
    queues: list[QueueConfig] = Field(default_factory=list)
    predictor: Endpoint | None = None
    tls: TlsConfig | None = Field(None, description="Mutual TLS; none (plaintext) by default.")
    authz: AuthzConfig | None = Field(
        None, description="Authorization and audit; none (every caller may do everything)."
    )
    autoscale: AutoscaleConfig | None = Field(None, description="Pools ``megha autoscale`` sizes.")
    broker: BrokerConfig | None = Field(
        None, description="Per-role broker users and the queue signing key; none by default."
    )

    @model_validator(mode="before")
    @classmethod
    def _named_worker_constraints(cls, data: Any) -> Any:
        """Worker groups may list constraint names: ids before the fields are checked."""
        if not isinstance(data, dict):
            return data
        names = data.get("constraint_names") or {}
        workers = data.get("workers", [])
        if not isinstance(names, dict) or not isinstance(workers, list):
            return data
        data = {**data, "workers": _named(workers, names, "worker group of {lm!r}")}
        autoscale = data.get("autoscale")
        if isinstance(autoscale, dict) and isinstance(autoscale.get("pools"), list):
            pools = _named(autoscale["pools"], names, "autoscale pool {name!r}")
            data["autoscale"] = {**autoscale, "pools": pools}
        return data

    @field_validator("max_node_capacity")
    @classmethod
    def _max_node_capacity_parses(cls, value: str) -> str:
        return _checked_bound(value)

    @field_validator("rabbitmq_url")
    @classmethod
    def _rabbitmq_urls(cls, value: str) -> str:
        urls = split_urls(value)
        if not urls:
            raise ValueError("rabbitmq_url names no broker")
        if len(urls) > 1:
            if any(url.startswith("memory://") for url in urls):
                raise ValueError(f"memory:// is one in-process broker, not a cluster node: {value}")
            # One cluster: the same vhost (and users) on every node, and one TLS setting.
            vhosts = {urlsplit(url).path.rstrip("/") or "/" for url in urls}
            schemes = {urlsplit(url).scheme for url in urls}
            if len(vhosts) > 1 or len(schemes) > 1:
                raise ValueError(
                    "rabbitmq_url lists the nodes of one cluster: one vhost and one scheme, "
                    f"got vhosts {sorted(vhosts)} and schemes {sorted(schemes)}"
                )
        return value

    @field_validator("constraint_names")
    @classmethod
    def _constraint_names(cls, value: dict[str, int]) -> dict[str, int]:
        for name in value:
            if not CONSTRAINT_NAME.fullmatch(name):
                raise ValueError(
                    f"constraint name {name!r}: letters, digits, _ . - and not a digit first"
                )
        ids = list(value.values())
        if len(set(ids)) != len(ids):
            raise ValueError(f"two constraint names for one id: {value}")
        return value

    @property
    def constraint_labels(self) -> dict[int, str]:
        """Id -> name, for messages."""
        return {c: name for name, c in self.constraint_names.items()}

    @model_validator(mode="after")
    def _consistent(self) -> FederationConfig:
        gm_ids = [g.id for g in self.gms]
        lm_ids = [m.id for m in self.lms]
        for kind, ids in (("GM", gm_ids), ("LM", lm_ids)):
            if len(set(ids)) != len(ids):
                raise ValueError(f"{kind} ids must be unique, got {ids}")
        bad_names = {
            n: c for n, c in self.constraint_names.items() if not 0 <= c < self.num_constraints
        }
        if bad_names:
            raise ValueError(f"constraint_names {bad_names} outside 0..{self.num_constraints - 1}")
        for group in self.workers:
            if group.lm not in lm_ids:
                raise ValueError(f"worker group names unknown LM {group.lm!r}; LMs: {lm_ids}")
            bad = [c for c in group.constraints if not 0 <= c < self.num_constraints]
            if bad:
                raise ValueError(f"worker constraints {bad} outside 0..{self.num_constraints - 1}")
        fence, beat, timeout = (
            self.worker_fence_s,
            self.worker_heartbeat_interval_s,
            self.worker_timeout_s,
        )
        if fence and not 2 * beat <= fence <= timeout - 1:
            raise ValueError(
                f"worker_fence_s {fence:g} must be 0 (off) or between twice "
                f"worker_heartbeat_interval_s ({2 * beat:g}) and worker_timeout_s - 1 "
                f"({timeout - 1:g})"
            )
        if self.autoscale is not None:
            self._pools_consistent(lm_ids)
        if self.authz is not None and (self.tls is None or not self.tls.dir):
            raise ValueError(
                "authz needs tls with dir (per-process identities): a server reads who "
                "calls from the caller's certificate"
            )
        self._nodes_within_bounds()
        names = [q.name for q in self.queues]
        if len(set(names)) != len(names):
            raise ValueError(f"queue names must be unique, got {names}")
        for queue in self.queues:
            if queue.gm not in gm_ids:
                raise ValueError(f"queue {queue.name!r} names unknown GM {queue.gm!r}")
        if sum(q.share for q in self.queues) > 1 + 1e-9:
            raise ValueError("queue shares add up to more than 1")
        self._ports_distinct()
        return self

    @field_validator("worker_run_as")
    @classmethod
    def _run_as_form(cls, value: str) -> str:
        if not _RUN_AS.fullmatch(value):
            raise ValueError(f"worker_run_as {value!r}: a user name or uid[:gid], e.g. 65534:65534")
        return value

    @model_validator(mode="after")
    def _no_root_tasks(self) -> FederationConfig:
        """A worker_run_as of root is refused unless allowed (a name that is uid 0 on a
        host only that host can tell: the worker refuses it when it starts)."""
        run_as = self.worker_run_as
        ids = run_as.split(":") if run_as[:1].isdigit() else []
        root = run_as == "root" or 0 in map(int, ids)
        if root and not self.worker_allow_root_tasks:
            raise ValueError(
                f"worker_run_as {run_as!r} runs tasks as root; set worker_allow_root_tasks: "
                "true to allow it"
            )
        return self

    def _pools_consistent(self, lm_ids: list[str]) -> None:
        assert self.autoscale is not None
        pools = self.autoscale.pools
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"autoscale pool names must be unique, got {names}")
        prefixes = {g.name_prefix or f"{g.lm}-w": f"worker group of {g.lm!r}" for g in self.workers}
        for pool in pools:
            if pool.lm not in lm_ids:
                raise ValueError(f"autoscale pool {pool.name!r} names unknown LM {pool.lm!r}")
            bad = [c for c in pool.constraints if not 0 <= c < self.num_constraints]
            if bad:
                raise ValueError(
                    f"autoscale pool {pool.name!r}: constraints {bad} outside "
                    f"0..{self.num_constraints - 1}"
                )
            clash = next((w for p, w in prefixes.items() if p == pool.prefix), None)
            if clash is not None:
                raise ValueError(
                    f"autoscale pool {pool.name!r} names its nodes {pool.prefix}<n>, as "
                    f"the {clash} does: set name_prefix"
                )
            prefixes[pool.prefix] = f"autoscale pool {pool.name!r}"

    def _nodes_within_bounds(self) -> None:
        """Every configured node fits its LM's max_node_capacity: its LM would refuse it."""
        pools = self.autoscale.pools if self.autoscale is not None else []
        nodes: list[tuple[str, _Nodes]] = [
            *((f"worker group of {g.lm!r}", g) for g in self.workers),
            *((f"autoscale pool {p.name!r}", p) for p in pools),
        ]
        for what, group in nodes:
            why = above_bound(parse_resources(group.capacity), self.node_capacity_bound(group.lm))
            if why:
                raise ValueError(
                    f"{what}: capacity {group.capacity!r} is above the max_node_capacity of "
                    f"LM {group.lm!r}: {why}"
                )

    def node_capacity_bound(self, lm_id: str) -> np.ndarray:
        """The most one node of ``lm_id`` may advertise: the federation's
        max_node_capacity, with what that LM's own names in its place."""
        bound = parse_bound(self.max_node_capacity)
        own = next((m.max_node_capacity for m in self.lms if m.id == lm_id), "")
        return parse_bound(own, bound)

    def _ports_distinct(self) -> None:
        """No two servers listen on one port of one host (the second would fail to start,
        or a client would reach the wrong service)."""
        servers: list[tuple[str, Endpoint]] = [
            *((f"GM {g.id}", g) for g in self.gms),
            *((f"LM {m.id}", m) for m in self.lms),
            *((("predictor", self.predictor),) if self.predictor is not None else ()),
        ]
        taken: dict[tuple[str, int], str] = {}
        for who, endpoint in servers:
            for what, port in (("port", endpoint.port), ("metrics_port", endpoint.metrics_port)):
                if not port:
                    continue
                where = (endpoint.host, port)
                if where in taken:
                    raise ValueError(f"{who} {what} {endpoint.host}:{port} is also {taken[where]}")
                taken[where] = f"{who}'s {what}"

    def with_journals(self, directory: Path) -> FederationConfig:
        """This config, with a journal file in ``directory`` for every LM that has none
        (how ``megha up`` runs its LMs: a restarted one remembers what ended on it)."""
        lms = [
            lm
            if lm.journal
            else lm.model_copy(update={"journal": str(directory / f"{lm.id}.journal")})
            for lm in self.lms
        ]
        return self.model_copy(update={"lms": lms})

    def placement_policy(self) -> PlacementPolicy:
        """A fresh instance of the configured policy (GM and LM each hold their own)."""
        return make_policy(self.policy, rho=self.gpa_rho)

    def broker_url(self, role: str) -> str:
        """``rabbitmq_url`` with the credentials of ``role``'s broker user (``gm``, ``lm``,
        ``reader``), read from its password file, on each of its URLs; the URL as it is
        when the role has none. Every process that connects to RabbitMQ takes its URL from
        here."""
        if role not in BROKER_ROLES:
            raise ValueError(f"unknown broker role {role!r}; roles: {', '.join(BROKER_ROLES)}")
        user = getattr(self.broker, role) if self.broker is not None else None
        if user is None:
            return self.rabbitmq_url
        password = read_secret(user.password_file)
        return ",".join(with_credentials(url, user.name, password) for url in self.rabbitmq_urls)

    @property
    def rabbitmq_urls(self) -> list[str]:
        """The broker nodes' URLs ``rabbitmq_url`` lists, in the order they are tried."""
        return split_urls(self.rabbitmq_url)

    def queue_signing_key(self) -> bytes | None:
        """The work-queue signing key, or None when the file names none."""
        return self._broker_key("queue_signing_key", "queue signing key")

    def task_seal_key(self) -> bytes | None:
        """The task seal key (GMs only), or None when the file names none."""
        return self._broker_key("task_seal_key", "task seal key")

    def _broker_key(self, field: str, what: str) -> bytes | None:
        path = getattr(self.broker, field) if self.broker is not None else ""
        if not path:
            return None
        from services.common.queue_signing import SigningKeyError, read_signing_key

        try:
            return read_signing_key(path, what)
        except SigningKeyError as err:
            raise ConfigError(str(err)) from None

    @property
    def broker_vhost(self) -> str:
        """The RabbitMQ vhost ``rabbitmq_url`` names (its path; ``/`` when it has none)."""
        path = urlsplit(self.rabbitmq_urls[0]).path
        return unquote(path[1:]) if len(path) > 1 else "/"

    # ------------------------------------------------------------ lookups
    @property
    def gm_ids(self) -> list[str]:
        return [g.id for g in self.gms]

    def gm(self, gm_id: str) -> GlobalMasterConfig:
        return _find(self.gms, gm_id, "GM")

    def lm(self, lm_id: str) -> LocalMasterConfig:
        return _find(self.lms, lm_id, "LM")

    def pool(self, name: str) -> AutoscalePool:
        pools = self.autoscale.pools if self.autoscale is not None else []
        for pool in pools:
            if pool.name == name:
                return pool
        known = ", ".join(p.name for p in pools) or "none"
        raise ConfigError(f"no autoscale pool {name!r} in the config (known: {known})")

    def queues_of(self, gm_id: str) -> list[QueueConfig]:
        return [q for q in self.effective_queues() if q.gm == gm_id]

    def queue(self, name: str) -> QueueConfig | None:
        return next((q for q in self.effective_queues() if q.name == name), None)

    def effective_queues(self) -> list[QueueConfig]:
        """The configured queues, or one ``default`` queue on the first GM."""
        if self.queues:
            return list(self.queues)
        return [QueueConfig(name="default", share=1.0, gm=self.gms[0].id)]


def _checked_bound(value: str) -> str:
    try:
        parse_bound(value)
    except ResourceError as err:
        raise ValueError(f"{value!r}: {err}") from None
    return value


def read_secret(path: str) -> str:
    """A password file's content less its final newline; ConfigError if unreadable or empty."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read password file {path}: {err.strerror}") from None
    secret = text.removesuffix("\n").removesuffix("\r")
    if not secret:
        raise ConfigError(f"password file {path} is empty")
    return secret


def split_urls(urls: str) -> list[str]:
    """The URLs of a comma-separated list (one URL is a list of one), blanks dropped."""
    return [url.strip() for url in urls.split(",") if url.strip()]


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with its user and password (if any) replaced by these, percent-encoded."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def _find(items: list[Any], item_id: str, kind: str) -> Any:
    for item in items:
        if item.id == item_id:
            return item
    known = ", ".join(i.id for i in items)
    raise ConfigError(f"no {kind} with id {item_id!r} in the config (known: {known})")


def default_config(
    gms: int = 2, lms: int = 3, workers_per_lm: int = 8, base_port: int = 50050
) -> dict:
    """The federation ``megha up`` starts without a file: loopback ports from base_port."""
    port = iter(range(base_port, base_port + 1000))
    metrics = iter(range(base_port + 100, base_port + 1000))  # Prometheus, one per process
    return {
        "gms": [
            {"id": f"gm-{i + 1}", "port": next(port), "metrics_port": next(metrics)}
            for i in range(gms)
        ],
        "lms": [
            {"id": f"lm-{i + 1}", "port": next(port), "metrics_port": next(metrics)}
            for i in range(lms)
        ],
        "workers": [
            {"lm": f"lm-{i + 1}", "count": workers_per_lm, "metrics_port": next(metrics)}
            for i in range(lms)
        ],
        "predictor": {"port": next(port), "metrics_port": next(metrics)},
    }


def _structured(annotation: Any) -> bool:
    """Whether a setting's value is more than one scalar (a list, a nested section), so
    that its ``MEGHA_*`` override is read as YAML."""
    return annotation not in (str, int, float, bool) and get_origin(annotation) is not Literal


def parse_config(data: dict[str, Any], env: dict[str, str] | None = None) -> FederationConfig:
    """Validate ``data`` after applying ``MEGHA_*`` overrides from ``env``."""
    env = dict(os.environ) if env is None else env
    merged = dict(data)
    for name, field in FederationConfig.model_fields.items():
        value = env.get(ENV_PREFIX + name.upper())
        if value is None:
            continue
        if _structured(field.annotation):
            try:
                merged[name] = yaml.safe_load(value)
            except yaml.YAMLError as err:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}: not valid YAML: {err}") from None
        else:
            merged[name] = value
    try:
        return FederationConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None, env: dict[str, str] | None = None) -> FederationConfig:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file; None = the default."""
    if path is None:
        return parse_config(default_config(), env)
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return parse_config(data, env)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def _explain(err: ValidationError) -> str:
    lines = []
    for problem in err.errors():
        where = ".".join(str(p) for p in problem["loc"]) or "config"
        lines.append(f"{where}: {problem['msg']}")
    return "invalid config: " + "; ".join(lines)
