"""A real federation for integration tests: every role a child process, real RabbitMQ.

Each federation gets its own free ports and its own broker namespace (exchange prefix),
so tests never see each other's messages, and its durable queues are deleted at the end.
Heartbeats are fast (0.25 s) so tests about staleness and crashes stay short.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import yaml

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.app.runner import running_gm, running_lm, running_workers
from services.app.supervisor import Children, start_federation, wait_until_ready
from services.common.bus import InMemoryBroker, RabbitBus, make_bus
from services.common.client import GlobalMasterClient
from services.common.config import FederationConfig, parse_config
from services.common.names import EVENT_EXCHANGE, EVERY_TASK_EVENT, cancel_queue, user_queue
from services.common.server import channel, wait_all_healthy

# Another broker node for a test run (e.g. chaos runs beside other tests: a broker
# restart must not reach them).
RABBITMQ_URL = os.environ.get("MEGHA_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
HEARTBEAT_S = 0.25


def broker_ctl(action: str) -> None:
    """``rabbitmqctl action`` (``stop_app``, ``start_app``) on the test broker: the node
    MEGHA_TEST_RABBITMQ_NODE names, when MEGHA_RABBITMQ_URL points at another one."""
    node = os.environ.get("MEGHA_TEST_RABBITMQ_NODE")
    where = ["-n", node] if node else []
    subprocess.run(["rabbitmqctl", *where, action], check=True, capture_output=True, timeout=60)


def free_ports(count: int) -> list[int]:
    socks, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def free_port_base(span: int = 120) -> int:
    """A base for ``megha up --base-port`` (it takes ports from the base on, and its
    metrics ports 100 above): below the kernel's ephemeral range, so no outgoing
    connection takes one meanwhile (a free port of that range, as ``free_ports`` gives,
    left ``base + 100`` to whatever connection came next: ``Address already in use``),
    with every port of ``span`` from it free now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000 - span)
        socks = []
        try:
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {span} free ports in a row below 32,000")


class Events:
    """Every lifecycle event of the federation, as the load generator would see them."""

    def __init__(self) -> None:
        self.events: list[common_pb2.TaskEvent] = []
        self.changed = asyncio.Event()

    async def on_batch(self, _key: str, body: bytes) -> None:
        self.events.extend(common_pb2.TaskEventBatch.FromString(body).events)
        self.changed.set()

    def states(self, state: int) -> Counter:
        return Counter(e.task_id for e in self.events if e.state == state)

    def succeeded(self) -> Counter:
        return self.states(common_pb2.TASK_STATE_SUCCEEDED)

    def runs(self) -> Counter:
        """How many times each task started, by the distinct start stamps of its events:
        an ending published twice (an LM that died before journalling it books it again
        from its worker) is one run."""
        starts = {(e.task_id, e.timestamps.started_unix_nanos) for e in self.events}
        return Counter(task_id for task_id, started in starts if started)

    def nodes_of(self, state: int = common_pb2.TASK_STATE_RUNNING) -> dict[str, str]:
        return {e.task_id: e.node_id for e in self.events if e.state == state}

    async def wait_succeeded(self, task_ids: set[str], timeout_s: float) -> None:
        await self.wait_state(task_ids, common_pb2.TASK_STATE_SUCCEEDED, timeout_s)

    async def wait_running(self, task_ids: set[str], timeout_s: float) -> None:
        await self.wait_state(task_ids, common_pb2.TASK_STATE_RUNNING, timeout_s)

    async def wait_state(self, task_ids: set[str], state: int, timeout_s: float) -> None:
        """Until every task of ``task_ids`` has had an event of ``state``."""
        deadline = time.monotonic() + timeout_s
        while not task_ids <= set(self.states(state)):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(task_ids - set(self.states(state)))
                name = common_pb2.TaskState.Name(state)
                raise AssertionError(f"{len(missing)} tasks never {name}, e.g. {missing[:5]}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))


class Federation:
    def __init__(
        self,
        tmp_path: Path,
        gms: int = 2,
        lms: int = 3,
        workers_per_lm: int = 8,
        capacity: str = "cpu=4,mem=8Gi",
        queues: list[dict] | None = None,
        worker_groups: list[dict] | None = None,
        metrics: bool = False,
        journal: bool = True,
        **overrides,
    ):
        ports = free_ports(2 * (gms + lms))
        self.prefix = f"it-{uuid.uuid4().hex[:8]}"
        data = {
            "rabbitmq_url": RABBITMQ_URL,
            "exchange_prefix": self.prefix,
            "heartbeat_interval_s": HEARTBEAT_S,
            "full_state_every": 4,
            "worker_heartbeat_interval_s": 0.25,
            "worker_timeout_s": 1.5,
            "worker_output_dir": str(tmp_path / "output"),
            "gms": [
                {
                    "id": f"gm-{i + 1}",
                    "port": ports[i],
                    "metrics_port": ports[gms + lms + i] * metrics,
                }
                for i in range(gms)
            ],
            "lms": [
                {
                    "id": f"lm-{i + 1}",
                    "port": ports[gms + i],
                    "journal": str(tmp_path / f"lm-{i + 1}.journal") if journal else "",
                }
                for i in range(lms)
            ],
            "workers": worker_groups
            if worker_groups is not None
            else [
                {"lm": f"lm-{i + 1}", "count": workers_per_lm, "capacity": capacity}
                for i in range(lms)
            ],
            **({"queues": queues} if queues else {}),
            **overrides,
        }
        self.config: FederationConfig = parse_config(data, env={})
        self.dir = tmp_path
        self.config_path = tmp_path / "federation.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config.model_dump(mode="json")))
        self.children = Children(tmp_path)
        self.bus = RabbitBus(
            self.config.rabbitmq_url,
            prefix=self.prefix,
            queue_type=self.config.queue_type,
            single_active=self.config.queue_failover,
        )
        self.events = Events()
        self.clients: dict[str, GlobalMasterClient] = {}

    # ---------------------------------------------------------------- control
    async def __aenter__(self) -> Federation:
        await self.bus.connect()
        await self.bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, self.events.on_batch)
        start_federation(self.config, self.config_path, self.children)
        try:
            await self.children.guard(wait_all_healthy(self.config, timeout_s=60))
            await self.children.guard(wait_until_ready(self.config, timeout_s=60))
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.clients.values():
            await client.close()
        self.children.stop()
        with contextlib.suppress(Exception):
            for q in self.config.effective_queues():
                await self.bus.delete_queue(user_queue(q.name))
            for process in (*self.config.gms, *self.config.lms):
                await self.bus.delete_queue(cancel_queue(process.id))
        await self.bus.close()

    def gm(self, gm_id: str = "gm-1") -> GlobalMasterClient:
        if gm_id not in self.clients:
            self.clients[gm_id] = GlobalMasterClient(self.config.gm(gm_id).target)
        return self.clients[gm_id]

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    async def lm_state(self, lm_id: str) -> common_pb2.LocalMasterState:
        async with channel(self.config.lm(lm_id).target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            reply = await stub.GetState(local_master_pb2.GetStateRequest(), timeout=5)
            return reply.state

    async def books(self) -> dict[str, common_pb2.LocalMasterState]:
        return {lm.id: await self.lm_state(lm.id) for lm in self.config.lms}

    async def assert_books_balanced(self) -> None:
        """Nothing over-committed; once idle, free == capacity and nothing allocated."""
        for lm_id, state in (await self.books()).items():
            free = state.free
            for i, node in enumerate(state.nodes):
                got = (free.cpu_milli[i], free.memory_mb[i])
                cap = (node.capacity.cpu_milli, node.capacity.memory_mb)
                assert got == cap, f"{lm_id}/{node.node_id}: free {got} != capacity {cap}"
            assert not state.allocations, f"{lm_id} still books {len(state.allocations)} tasks"

    async def metric(self, gm_id: str, name: str) -> float:
        """Sum of a Prometheus metric on a GM's metrics endpoint (needs ``metrics=True``)."""
        port = self.config.gm(gm_id).metrics_port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        body = (await reader.read()).decode()
        writer.close()
        total = 0.0
        for line in body.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def sim_tasks(count: int, duration_s: float, cpu_milli: int = 1000, constraints=()):
    tasks = []
    for _ in range(count):
        task = common_pb2.Task(constraints=list(constraints), expected_duration_s=duration_s)
        task.resources.cpu_milli = cpu_milli
        task.resources.memory_mb = 256
        task.sim.duration_s = duration_s
        tasks.append(task)
    return tasks


def shell_task(script: str, retries: int = 0) -> common_pb2.Task:
    """A process task that runs ``sh -c script`` on 500m CPU and 128 MiB."""
    task = common_pb2.Task(
        process=common_pb2.ProcessExecutor(args=["sh", "-c", script]), max_retries=retries
    )
    task.resources.cpu_milli, task.resources.memory_mb = 500, 128
    return task


def by_node(events: list[common_pb2.TaskEvent]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for e in events:
        if e.state == common_pb2.TASK_STATE_RUNNING:
            out[e.node_id].append(e.task_id)
    return out


@contextlib.asynccontextmanager
async def embedded_federation(
    prefix: str, hosts: list | None = None, silent_lms: int = 0, **overrides
):
    """In this process on the in-memory bus (as ``megha up --embedded``): one GM, one LM
    with two workers of 4 CPUs. Yields (config, the GM, the GM's bus, a client).
    ``overrides`` go into the config; ``hosts``, when given, receives the worker host;
    ``silent_lms`` more LMs (lm-2, ...) are in the config but never run."""
    gm_port, lm_port, *silent = free_ports(2 + silent_lms)
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": gm_port}],
            "lms": [
                {"id": "lm-1", "port": lm_port},
                *({"id": f"lm-{i + 2}", "port": port} for i, port in enumerate(silent)),
            ],
            "workers": [{"lm": "lm-1", "count": 2, "capacity": "cpu=4,mem=8Gi"}],
            "heartbeat_interval_s": 0.2,
            "exchange_prefix": prefix,
            **overrides,
        },
        env={},
    )
    broker = InMemoryBroker()
    async with (
        make_bus("memory://", broker=broker) as lm_bus,
        running_lm(config, "lm-1", lm_bus),
        running_workers(config, None, None) as started,
        make_bus("memory://", broker=broker) as gm_bus,
        running_gm(config, "gm-1", gm_bus) as gm,
        GlobalMasterClient(config.gm("gm-1").target) as client,
    ):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the GM knows the LM and both workers
            view = await client.cluster()
            if sum(p.node_count for lm in view.lms for p in lm.partitions) == 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the GM never saw the workers")
        if hosts is not None:
            hosts.extend(started)
        yield config, gm, gm_bus, client


class StoredAfterAll:
    """A broker delivery handed to ``GlobalMaster._on_delivery`` by a test: a message the
    GM saw fail to publish (a lost confirm), or a second message of a job."""

    def __init__(self, body: bytes, redelivered: bool = False) -> None:
        self.body = body
        self.redelivered = redelivered
        self.acked = False

    async def ack(self) -> None:
        self.acked = True

    async def nack(self, requeue: bool = True) -> None:
        raise AssertionError("not expected")


async def lm_lookup(config, task_ids: list[str], lm_id: str = "lm-1") -> list:
    """What ``lm_id`` knows of ``task_ids`` (``LookupTasks``: its KnownTasks)."""
    async with channel(config.lm(lm_id).target) as ch:
        stub = local_master_pb2_grpc.LocalMasterStub(ch)
        known = await stub.LookupTasks(
            local_master_pb2.LookupTasksRequest(task_ids=task_ids), timeout=5
        )
    return list(known.tasks)


async def lm_knows(config, task_ids: list[str]) -> list[str]:
    """Which of ``task_ids`` lm-1 has ever booked."""
    return [t.task_id for t in await lm_lookup(config, task_ids)]


async def hog(client, seconds: float) -> None:
    """Fill both workers of ``embedded_federation`` for ``seconds`` (job "hog"), so that
    what is submitted next waits in the GM's queue, where it can be counted."""
    await client.submit(sim_tasks(2, seconds, cpu_milli=4000), job_id="hog")
    await job_in_state(client, "hog", common_pb2.TASK_STATE_RUNNING, timeout_s=10)


async def job_in_state(client, job_id: str, state: int, timeout_s: float = 20):
    """Poll ``GetJob`` until every task of the job is in ``state``; returns the job."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = await client.job(job_id)
        if job.tasks and all(t.state == state for t in job.tasks):
            return job
        if time.monotonic() > deadline:
            states = sorted({common_pb2.TaskState.Name(t.state) for t in job.tasks})
            raise AssertionError(
                f"job {job_id} not all {common_pb2.TaskState.Name(state)}: {states}"
            )
        await asyncio.sleep(0.05)


HEALTHCHECK = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"


async def container_health_check(target: str, config_path: Path) -> None:
    """The containers' health check (``docker/healthcheck.py``, which reads the
    federation file without megha) against ``target``: it must say SERVING."""
    env = {**os.environ, "MEGHA_HEALTH_TARGET": target, "MEGHA_CONFIG": str(config_path)}
    probe = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(HEALTHCHECK)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr


@contextlib.asynccontextmanager
async def lm_alone(config: FederationConfig, lm_id: str = "lm-1"):
    """A real LM in this process on the in-memory bus, and a stub to it: a test that
    plays its GM and its workers itself."""
    async with (
        make_bus("memory://", broker=InMemoryBroker()) as bus,
        running_lm(config, lm_id, bus),
        channel(config.lm(lm_id).target) as ch,
    ):
        yield local_master_pb2_grpc.LocalMasterStub(ch)


async def register_worker(lm, node_id: str, cpu_milli: int = 2000, memory_mb: int = 4096) -> int:
    """Register ``node_id`` with the LM behind stub ``lm``: its node index."""
    register = local_master_pb2.RegisterWorkerRequest(node_id=node_id)
    register.capacity.cpu_milli, register.capacity.memory_mb = cpu_milli, memory_mb
    return (await lm.RegisterWorker(register, timeout=5)).node_index
