"""Many worker agents in one process: one ``WorkerGroup`` of the federation config.

All agents of a host share one gRPC channel to their LM and one heartbeat call on it
(``HostLink``: every agent's heartbeat stream is a node stream of that call), so a host
of thousands of simulated nodes costs one socket and writes one message where each node
wrote its own, and they share one set of executors (one Docker client).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import grpc
import numpy as np

from services.common import server
from services.common.config import ConfigError, FederationConfig, WorkerGroup
from services.core.resources import parse_resources
from services.worker.agent import WorkerAgent
from services.worker.executors import (
    DockerExecutor,
    Executor,
    default_executors,
    switch_prefix,
)
from services.worker.janitor import Janitor
from services.worker.leftovers import GroupLedger
from services.worker.link import HostLink
from services.worker.machine import Machine, cap_to_machine, machine
from services.worker.outputs import TaskOutputs
from services.worker.runas import RunAs, RunAsError, TaskDirs

log = logging.getLogger("megha.worker")

REGISTRATION_CONCURRENCY = 256


def node_ids(group: WorkerGroup, index_offset: int = 0) -> list[str]:
    """The node ids of a group: ``<name_prefix or '<lm>-w'><i>`` from the offset on."""
    prefix = group.name_prefix or f"{group.lm}-w"
    return [f"{prefix}{i}" for i in range(index_offset, index_offset + group.count)]


ADVERTISE_HOST_ENV = "MEGHA_ADVERTISE_HOST"


def advertised_address(group: WorkerGroup, env: Mapping[str, str] | None = None) -> str:
    """The address each node of ``group`` advertises to its LM: this machine as others
    reach it (``MEGHA_ADVERTISE_HOST``, else the group's ``host``), with the group's
    metrics port, the one port a worker host serves; empty when neither names a host."""
    env = os.environ if env is None else env
    host = env.get(ADVERTISE_HOST_ENV, "").strip() or group.host
    if not host or not group.metrics_port:
        return host
    if ":" in host and not host.startswith("["):  # an IPv6 address
        host = f"[{host}]"
    return f"{host}:{group.metrics_port}"


def advertised(group: WorkerGroup, host: Machine | None = None) -> np.ndarray:
    """What each node of ``group`` advertises to its LM: its configured capacity, but for
    nodes that run real tasks (process, docker) no more CPU or memory than the machine
    (``host``, default this one) has, unless ``capacity_beyond_host`` says so."""
    capacity = parse_resources(group.capacity)
    if group.executor == "sim" or group.capacity_beyond_host:
        return capacity
    host = machine() if host is None else host
    capped, cut = cap_to_machine(capacity, host)
    if cut:
        log.warning(
            "capacity cut down to this machine's",
            extra={
                "lm_id": group.lm,
                "configured": group.capacity,
                "cut": "; ".join(cut),
                "override": "capacity_beyond_host: true",
            },
        )
    return capped


class WorkerHost:
    """Hosts ``group.count`` agents attached to ``group.lm``.

    ``index_offset`` numbers the nodes of a second process of the same group apart from
    the first one's. Use ``async with WorkerHost(...)`` or ``run()`` + ``shutdown()``.
    """

    def __init__(self, config: FederationConfig, group: WorkerGroup, index_offset: int = 0) -> None:
        self.config = config
        self.group = group
        self.target = config.lm(group.lm).target
        self.node_ids = node_ids(group, index_offset)
        self.capacity = advertised(group)
        self.address = advertised_address(group)
        self.agents: list[WorkerAgent] = []
        self._channel: grpc.aio.Channel | None = None
        self._link: HostLink | None = None
        self._executors: dict[str, Executor] = {}
        self._agent_tasks: list[asyncio.Task[None]] = []
        self._run_task: asyncio.Task[None] | None = None
        # One file per host of one federation on this machine (prefix, LM, first node).
        name = f"{config.exchange_prefix}-{self.target}-{self.node_ids[0]}".replace(":", "_")
        ledgers = Path(tempfile.gettempdir()) / f"megha-{os.getuid()}"
        janitor = Janitor(uuid.uuid4().hex[:12]) if config.worker_janitor else None
        self._ledger = GroupLedger(ledgers / f"{name}.groups", janitor)
        outputs = config.worker_output_dir or ledgers / "output"
        self._outputs_dir = Path(outputs) / name  # a directory per host
        self._outputs: TaskOutputs | None = None
        # Whom its tasks run as: refused here, before any agent registers, if it is root
        # without leave or a user this host cannot switch to.
        try:
            self._run_as = RunAs.resolve(
                config.worker_run_as,
                config.worker_allow_root_tasks,
                config.worker_task_max_processes,
            )
            user = self._run_as.process
            switch_prefix(user)  # can this host switch to it at all?
            self._task_dirs = TaskDirs(ledgers / "tasks" / name, user) if user.switch else None
        except (RunAsError, OSError) as err:
            raise ConfigError(f"worker of {group.lm!r}: {err}") from None
        self._shutdown_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WorkerHost:
        self._start()
        self._run_task = asyncio.create_task(self._supervise(), name="worker host")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()
        if self._run_task is not None:
            (outcome,) = await asyncio.gather(self._run_task, return_exceptions=True)
            if exc is None and isinstance(outcome, Exception):
                raise outcome

    @property
    def link(self) -> HostLink | None:
        """The agents' one heartbeat call (None before the host starts)."""
        return self._link

    async def run(self) -> None:
        """Run every agent until ``shutdown()``; if one fails for good, stop all and raise."""
        self._start()
        await self._supervise()

    async def wait_connected(self) -> None:
        """Return once every agent has registered and opened its heartbeat stream."""
        self._start()
        await asyncio.gather(*(agent.wait_connected() for agent in self.agents))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Shut every agent down (their tasks are reported LOST), then close the channel."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self._shutdown(timeout))
        await asyncio.shield(self._shutdown_task)

    def _start(self) -> None:
        if self._channel is not None:
            return
        if self._shutdown_task is not None:
            raise RuntimeError("this worker host was shut down; make a new one")
        # Created here, not in __init__: a grpc.aio channel belongs to the running loop.
        # The shared options cap gRPC's reconnect backoff: without them, agents polling an
        # LM that was down for 40 s reached it again 20-27 s after it was back.
        self._channel = server.channel(self.target)
        self._link = HostLink(self._channel, self.config.worker_stream_life_s)
        # Before any agent registers: what a crashed former life of this host left
        # running must be gone before the LM re-queues those tasks elsewhere.
        self._ledger.sweep()
        if self._task_dirs is not None:  # its former life's tasks are gone: so are their dirs
            self._task_dirs.sweep()
        try:
            self._outputs = TaskOutputs(
                self._outputs_dir,
                self.config.worker_output_keep,
                self.config.worker_output_max_mb << 20,
                int(self.config.worker_output_max_gb * (1 << 30)),
            )
        except OSError as err:  # the tasks matter more than their output: run them anyway
            log.error(
                "tasks' output will not be kept",
                extra={"dir": str(self._outputs_dir), "why": err.strerror or str(err)},
            )
        self._executors = default_executors(
            self._ledger,
            self._outputs,
            self.config.worker_memory_check_s,
            self._run_as,
            self._task_dirs,
        )
        interval = self.config.worker_heartbeat_interval_s
        # Concurrent, but not all at once: a gRPC server cancels calls beyond its pending
        # limit (grpc.server.max_pending_requests, 1000 by default), and a cancelled
        # registration costs the agent a backoff.
        slots = asyncio.Semaphore(REGISTRATION_CONCURRENCY)
        self.agents = [
            WorkerAgent(
                node_id,
                self.capacity,
                list(self.group.constraints),
                self._channel,
                default_executor=self.group.executor,
                heartbeat_interval_s=interval,
                stream_life_s=self.config.worker_stream_life_s,
                fence_s=self.config.worker_fence_s,
                executors=self._executors,
                registration_slots=slots,
                outputs=self._outputs,
                address=self.address,
                link=self._link,
            )
            for node_id in self.node_ids
        ]
        # Every agent registers on its own task, so they register concurrently.
        self._agent_tasks = [
            asyncio.create_task(agent.run(), name=f"worker {agent.node_id}")
            for agent in self.agents
        ]
        user = self._run_as.process
        if user.uid == 0:
            log.warning(
                "tasks run as root (worker_allow_root_tasks)", extra={"lm_id": self.group.lm}
            )
        log.info(
            "worker host started",
            extra={
                "lm_id": self.group.lm,
                "target": self.target,
                "advertised": self.address,
                "agents": len(self.agents),
                "tasks_run_as": f"{user.name} ({user.uid}:{user.gid})",
                "containers_run_as": self._run_as.container,
            },
        )

    async def _supervise(self) -> None:
        pending = set(self._agent_tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                await self.shutdown()
                raise failed[0].exception()  # type: ignore[misc]

    async def _shutdown(self, timeout: float) -> None:
        await asyncio.gather(
            *(agent.shutdown(timeout) for agent in self.agents), return_exceptions=True
        )
        for task in self._agent_tasks:
            task.cancel()
        await asyncio.gather(*self._agent_tasks, return_exceptions=True)
        if self._link is not None:
            await self._link.close()
        if self._channel is not None:
            await self._channel.close()
        docker = self._executors.get("docker")
        if isinstance(docker, DockerExecutor):
            docker.close()
        self._ledger.close()
        if self._outputs is not None:
            await asyncio.to_thread(self._outputs.stop)
        link = self._link
        log.info(
            "worker host stopped",
            extra={
                "lm_id": self.group.lm,
                # What its one heartbeat call carried: node heartbeats per message.
                "messages_written": link.messages_written if link else 0,
                "heartbeats_written": link.heartbeats_written if link else 0,
            },
        )
