"""Who calls, and may they: identities from certificates or tokens, one check per call,
and the audit log.

    call ──TLS──▶ CheckedRequests ──parse──▶ Authorizer.check ──▶ servicer
                                                  ├── refused ──▶ PERMISSION_DENIED + audit line
                                                  └── state-changing ──▶ audit line

Every process and user has an identity, ``role/name``, read from the URI of its
certificate (``spiffe://megha/gm/gm-1``; ``megha certs`` issues them) or, for users, from
a bearer token whose SHA-256 the federation file holds. Two layers decide:

- **Roles** (``RPC_ROLES``): which roles may call each RPC. Only GMs launch, repartition
  and preempt on an LM; only worker hosts register and report to one; only LMs command a
  worker (and a worker host only its own LM: the servicers check the name). An admin may
  call everything; a method not in the table is refused to everyone else (fail closed).
- **Queues** (``FederationConfig.authz.users``): a user may ``submit`` to, ``watch`` and
  ``cancel`` (their own jobs) in the queues their entry names.

The decision is pure (``Policy.decide``); ``Authorizer`` feeds it a call's identity and
request and writes the audit log (one JSON line per state-changing or refused call).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from services.common.config import AuthzConfig

log = logging.getLogger("megha.authz")

SPIFFE_PREFIX = "spiffe://megha/"
# "client": a certificate that admits a connection and names no one (token users show it).
ROLES = frozenset(
    {"gm", "lm", "worker", "predictor", "autoscaler", "console", "user", "admin", "client"}
)

_GM = "/megha.v1.GlobalMaster/"
_LM = "/megha.v1.LocalMaster/"
_WORKER = "/megha.v1.Worker/"
_PREDICTOR = "/megha.v1.Predictor/"
_READERS = frozenset({"user", "console", "autoscaler", "gm"})

# Which roles may call each RPC (admin: every one). Health and reflection: anyone.
RPC_ROLES: dict[str, frozenset[str]] = {
    _GM + "SubmitJob": frozenset({"user"}),
    _GM + "SubmitStream": frozenset({"user"}),
    _GM + "PlanJob": frozenset({"user", "console"}),
    _GM + "CancelJob": frozenset({"user"}),
    _GM + "GetJob": _READERS,
    _GM + "WatchJob": _READERS,
    _GM + "GetTaskOutput": _READERS,
    _GM + "ListJobs": _READERS,
    _GM + "GetClusterView": _READERS,
    _LM + "Launch": frozenset({"gm"}),
    _LM + "LaunchStream": frozenset({"gm"}),
    _LM + "Repartition": frozenset({"gm"}),
    _LM + "Preempt": frozenset({"gm"}),
    _LM + "ReserveGang": frozenset({"gm"}),
    _LM + "CommitGang": frozenset({"gm"}),
    _LM + "ReleaseGang": frozenset({"gm"}),
    _LM + "StopTasks": frozenset({"gm"}),
    _LM + "LookupTasks": frozenset({"gm"}),
    _LM + "GetState": frozenset({"gm", "console", "autoscaler"}),
    _LM + "ListTasks": frozenset({"gm", "console"}),
    _LM + "GetTaskOutput": frozenset({"gm"}),
    _LM + "DrainNode": frozenset({"autoscaler", "console"}),  # console: query only
    _LM + "RegisterWorker": frozenset({"worker"}),
    _LM + "WorkerHeartbeats": frozenset({"worker"}),
    _LM + "HostHeartbeats": frozenset({"worker"}),
    _LM + "ReportTask": frozenset({"worker"}),
    _LM + "SendTaskOutput": frozenset({"worker"}),
    _WORKER + "StartTask": frozenset({"lm"}),
    _WORKER + "KillTask": frozenset({"lm"}),
    _WORKER + "GetWorkerInfo": frozenset({"lm"}),
    _PREDICTOR + "PredictLifetime": frozenset({"gm", "lm"}),
    _PREDICTOR + "FitGpa": frozenset({"gm", "lm"}),
    _PREDICTOR + "ForecastDemand": frozenset({"gm", "autoscaler", "console"}),
}
_OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
# Calls between a worker host and its own LM only: the caller's name must be the name of
# the server's process (worker hosts of lm-1 are worker/lm-1; its LM is lm/lm-1).
PAIRED = frozenset(
    {
        _LM + "RegisterWorker",
        _LM + "WorkerHeartbeats",
        _LM + "HostHeartbeats",
        _LM + "ReportTask",
        _LM + "SendTaskOutput",
        _WORKER + "StartTask",
        _WORKER + "KillTask",
        _WORKER + "GetWorkerInfo",
    }
)

# The queue right a user's call needs, and whether the queue is named by the request
# (``queue``) or found from its job (``job``).
_USER_RIGHTS: dict[str, tuple[str, str]] = {
    _GM + "SubmitJob": ("submit", "queue"),
    _GM + "SubmitStream": ("submit", "queue"),
    _GM + "PlanJob": ("submit", "queue"),
    _GM + "CancelJob": ("cancel", "job"),
    _GM + "GetJob": ("watch", "job"),
    _GM + "WatchJob": ("watch", "job"),
    _GM + "GetTaskOutput": ("watch", "job"),
}
# Calls that change state: each leaves an audit line, allowed or not. (The per-task
# traffic between GMs, LMs and workers is audited only when refused.)
AUDITED = frozenset(
    {
        _GM + "SubmitJob",
        _GM + "SubmitStream",
        _GM + "CancelJob",
        _LM + "DrainNode",
        _LM + "RegisterWorker",
        _LM + "Repartition",
    }
)

STREAMED_AUDIT = frozenset({_GM + "SubmitStream"})


@dataclass(frozen=True)
class Principal:
    """Who calls: ``role`` (one of ``ROLES``, or "" when unknown) and ``name``."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}/{self.name}" if self.role else "anonymous"


ANONYMOUS = Principal("", "")
# The caller of the call being served (set by ``Authorizer`` for the servicer's use).
caller: contextvars.ContextVar[Principal] = contextvars.ContextVar("caller", default=ANONYMOUS)


def parse_identity(uri: str) -> Principal | None:
    """``spiffe://megha/<role>/<name>`` as a principal; None for any other URI."""
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    role, _, name = uri[len(SPIFFE_PREFIX) :].partition("/")
    if role not in ROLES or not name:
        return None
    return Principal(role, name)


def identity_name(identity: str | None) -> str:
    """The process name an identity's audit lines carry (``gm/gm-1`` -> ``gm.gm-1``)."""
    identity = identity or os.environ.get("MEGHA_IDENTITY") or "admin/operator"
    return identity.replace("/", ".")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Job:
    """What the policy needs of a job: its queue and who submitted it ("" unknown)."""

    queue: str
    owner: str


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str = ""


ALLOW = Verdict(True)


class Policy:
    """The pure decision: may ``who`` call ``method`` on this queue or job."""

    def __init__(
        self,
        users: Mapping[str, Any],
        default_queue: str = "default",
        own: Principal = ANONYMOUS,
        roles: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.users = users  # name -> UserConfig
        self.default_queue = default_queue
        self.own = own  # the identity of the process whose servers decide
        # ``RPC_ROLES``, with the federation file's ``authz.roles`` ("Service/Method") over it
        self.rpc_roles = dict(RPC_ROLES)
        for rpc, allowed in (roles or {}).items():
            self.rpc_roles[f"/megha.v1.{rpc}"] = frozenset(allowed)
        self._tokens = {u.token_sha256: n for n, u in users.items() if u.token_sha256}

    def user_of_token(self, token: str) -> Principal | None:
        name = self._tokens.get(token_hash(token))
        return None if name is None else Principal("user", name)

    def is_admin(self, who: Principal) -> bool:
        if who.role == "admin":
            return True
        user = self.users.get(who.name) if who.role == "user" else None
        return bool(user and user.admin)

    def may(self, who: Principal, right: str, queue: str) -> bool:
        """Whether ``who`` holds ``right`` on ``queue`` (an admin holds every right)."""
        if self.is_admin(who):
            return True
        user = self.users.get(who.name) if who.role == "user" else None
        if user is None:
            return False
        return right in user.queues.get(queue or self.default_queue, ()) or right in (
            user.queues.get("*", ())
        )

    def decide_role(self, who: Principal, method: str) -> Verdict:
        if method.startswith(_OPEN_PREFIXES) or self.is_admin(who):
            return ALLOW
        if not who.role:
            return Verdict(False, "no identity: show a megha certificate or a token")
        roles = self.rpc_roles.get(method)
        if roles is None:
            return Verdict(False, f"{method} is for admins only")
        if who.role not in roles:
            return Verdict(False, f"{who} may not call {_short(method)} (role {who.role})")
        if who.role == "user" and who.name not in self.users:
            return Verdict(False, f"{who} is not a user of this federation")
        if method in PAIRED and self.own.role in ("lm", "worker") and who.name != self.own.name:
            return Verdict(False, f"{who} may not call {_short(method)} of {self.own}: not its own")
        return ALLOW

    def decide(
        self,
        who: Principal,
        method: str,
        queue: str | None,
        job: Job | None,
        query: bool = False,
    ) -> Verdict:
        """The whole decision for one request: its role, then (users) its queue right.
        ``queue`` is the queue a request names; ``job`` the job it names, if known;
        ``query``: the request only asks (a DrainNode query)."""
        verdict = self.decide_role(who, method)
        if verdict.allowed and who.role == "console" and method == _LM + "DrainNode" and not query:
            return Verdict(False, f"{who} may only query a node's drain, not change it")
        if not verdict.allowed or who.role != "user" or self.is_admin(who):
            return verdict
        need = _USER_RIGHTS.get(method)
        if need is None:
            return ALLOW
        right, source = need
        if source == "job":
            if job is None:
                if right == "cancel":  # only a job known to be theirs
                    return Verdict(False, f"{who} may cancel only a job this GM knows is theirs")
                return ALLOW  # the servicer says NOT_FOUND
            queue = job.queue
            if right == "cancel" and job.owner != str(who):
                return Verdict(False, f"{who} may not cancel a job of {job.owner or 'unknown'}")
        queue = queue or self.default_queue
        if not self.may(who, right, queue):
            return Verdict(False, f"{who} may not {right} in queue {queue!r}")
        return ALLOW


def _short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


def principal_of(context: Any, policy: Policy) -> Principal:
    """The caller of a call: its certificate's megha URI, or for a certificate that names
    no one (``client/...``), the user of its bearer token."""
    auth = context.auth_context() or {}
    for uri in (*auth.get("peer_spiffe_id", ()), *auth.get("x509_subject_alternative_name", ())):
        who = parse_identity(uri.decode(errors="replace"))
        if who is not None and who.role != "client":
            return who
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return policy.user_of_token(value[7:].strip()) or ANONYMOUS
    return ANONYMOUS


class Audit:
    """One JSON line per audited call, to a file (appended) or stdout."""

    def __init__(self, target: str, process: str) -> None:
        self._out: IO[str] | None = None
        if target == "-":
            self._out = sys.stdout
        elif target:
            path = Path(target.replace("{process}", process))
            path.parent.mkdir(parents=True, exist_ok=True)
            self._out = path.open("a", buffering=1, encoding="utf-8")
        self.process = process

    def write(self, who: Principal, method: str, verdict: Verdict, **what: Any) -> None:
        if self._out is None:
            return
        line = {
            "ts": round(time.time(), 3),
            "process": self.process,
            "who": str(who),
            "call": _short(method),
            **{k: v for k, v in what.items() if v not in ("", None)},
            "verdict": "allowed" if verdict.allowed else "denied",
        }
        if verdict.reason:
            line["reason"] = verdict.reason
        self._out.write(json.dumps(line, separators=(",", ":")) + "\n")


JobLookup = Callable[[str], Job | None]


def _what(request: Any) -> dict[str, Any]:
    """The job, queue, node and task count a request names, for the audit log."""
    what: dict[str, Any] = {}
    inner = getattr(request, "submit", None) if request is not None else None
    request = inner if inner is not None and inner.ByteSize() else request
    for name in ("job_id", "queue", "node_id", "lm_id"):
        value = getattr(request, name, "")
        if isinstance(value, str) and value:
            what[name] = value
    tasks = getattr(request, "tasks", None)
    if tasks is not None and len(tasks):
        what["tasks"] = len(tasks)
    return what


class Authorizer:
    """Checks each call of a server (see the module docstring). ``jobs`` finds a job's
    queue and owner for the calls that name a job (the GM's job book)."""

    def __init__(self, policy: Policy, audit: Audit, jobs: JobLookup | None = None) -> None:
        self.policy = policy
        self.audit = audit
        self.jobs = jobs

    def identify(self, context: Any) -> Principal:
        who = principal_of(context, self.policy)
        caller.set(who)
        return who

    async def check_call(self, method: str, context: Any) -> Principal:
        """At a call's start (streams: before any message): its role."""
        who = self.identify(context)
        verdict = self.policy.decide_role(who, method)
        if not verdict.allowed:
            await self._deny(who, method, verdict, None, context)
        return who

    async def check(self, method: str, request: Any, context: Any, who: Principal) -> None:
        """One request (a unary call's, or each message of a stream)."""
        queue = None
        job = None
        body = getattr(request, "submit", None) if method.endswith("SubmitStream") else request
        if method in _USER_RIGHTS:
            queue = getattr(body, "queue", "")
            job_id = getattr(body, "job_id", "")
            if _USER_RIGHTS[method][1] == "job" and self.jobs is not None and job_id:
                job = self.jobs(job_id)
        query = method == _LM + "DrainNode" and bool(request.query)
        verdict = self.policy.decide(who, method, queue, job, query)
        if not verdict.allowed:
            await self._deny(who, method, verdict, request, context)
        if method in STREAMED_AUDIT:  # each message, as allowed (the stream answers later)
            self.audit.write(who, method, verdict, **_what(request))

    def answered(self, method: str, request: Any, code: grpc.StatusCode) -> None:
        """A unary call allowed in, answered with ``code``: its audit line, if it changes
        state (``AUDITED``)."""
        if method in AUDITED and method not in STREAMED_AUDIT:
            denied = code == grpc.StatusCode.PERMISSION_DENIED  # by the servicer's own rule
            verdict = Verdict(False, "refused by the service") if denied else ALLOW
            self.audit.write(caller.get(), method, verdict, **_what(request), code=code.name)

    async def _deny(self, who, method, verdict: Verdict, request, context) -> None:
        log.warning(
            "call refused", extra={"who": str(who), "call": _short(method), "why": verdict.reason}
        )
        self.audit.write(who, method, verdict, **_what(request))
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, verdict.reason)


_authz: tuple[Policy, Audit] | None = None  # set by use_authz, for every server of the process


def use_authz(
    config: AuthzConfig | None, identity: str | None = None, default_queue: str = "default"
) -> None:
    """Check every call to this process's servers against ``config`` (None: no checks);
    ``identity`` (``role/name``; None: $MEGHA_IDENTITY, else ``admin/operator``) is the
    process's own. Call it once at start-up, before any server starts."""
    global _authz
    if config is None:
        _authz = None
        return
    process = identity_name(identity)
    role, _, name = process.partition(".")
    own = Principal(role, name)
    policy = Policy(config.users, default_queue, own, config.roles)
    _authz = (policy, Audit(config.audit, process))


def authorizer(jobs: JobLookup | None = None) -> Authorizer | None:
    """The process's authorizer for one server (None when authorization is off)."""
    if _authz is None:
        return None
    return Authorizer(*_authz, jobs=jobs)


def enabled() -> bool:
    return _authz is not None


def policy() -> Policy | None:
    return None if _authz is None else _authz[0]
