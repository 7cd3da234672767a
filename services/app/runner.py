"""Run services as processes: one service per ``megha <role>``, or all of them in one
process for ``megha up --embedded``. Each role is started, waits for SIGINT/SIGTERM,
and shuts down gracefully (health NOT_SERVING, in-flight calls drained, bus closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

from services._proto.megha.v1 import (
    global_master_pb2,
    global_master_pb2_grpc,
    local_master_pb2,
    local_master_pb2_grpc,
    predictor_pb2,
    predictor_pb2_grpc,
)
from services.common import stalls
from services.common.bus import Bus, InMemoryBroker, make_bus
from services.common.config import FederationConfig, WorkerGroup
from services.common.server import Service, start_metrics, wait_all_healthy
from services.common.tasks import install_dump

log = logging.getLogger("megha.runner")


def _full_name(module, service: str) -> str:
    return module.DESCRIPTOR.services_by_name[service].full_name


@contextlib.asynccontextmanager
async def _serving(endpoint, add_servicer, servicer, module, name: str, *, servicer_first: bool):
    """``servicer`` (with ``start``/``shutdown``) behind a gRPC ``Service`` on
    ``endpoint``; ``servicer_first`` starts it before the server takes calls."""
    service = Service(
        endpoint.listen,
        [(add_servicer, servicer, _full_name(module, name))],
        metrics_port=endpoint.metrics_port,
    )
    first, second = (servicer, service) if servicer_first else (service, servicer)
    await first.start()
    await second.start()
    try:
        yield servicer
    finally:
        await service.stop()
        await servicer.shutdown()


@contextlib.asynccontextmanager
async def running_lm(config: FederationConfig, lm_id: str, bus: Bus) -> AsyncIterator:
    from services.local_master.service import LocalMaster

    lm = LocalMaster(config, lm_id, bus)
    add = local_master_pb2_grpc.add_LocalMasterServicer_to_server
    # The server first: a GM that hears the LM's first heartbeat can call it at once.
    async with _serving(
        config.lm(lm_id), add, lm, local_master_pb2, "LocalMaster", servicer_first=False
    ):
        yield lm


@contextlib.asynccontextmanager
async def running_gm(config: FederationConfig, gm_id: str, bus: Bus) -> AsyncIterator:
    from services.global_master.service import GlobalMaster

    gm = GlobalMaster(config, gm_id, bus)
    add = global_master_pb2_grpc.add_GlobalMasterServicer_to_server
    # The GM first: it consumes its queues and hears heartbeats before it takes jobs.
    async with _serving(
        config.gm(gm_id), add, gm, global_master_pb2, "GlobalMaster", servicer_first=True
    ):
        yield gm


@contextlib.asynccontextmanager
async def running_predictor(config: FederationConfig) -> AsyncIterator:
    from services.predictor.service import PredictorService

    assert config.predictor is not None
    service = Service(
        config.predictor.listen,
        [
            (
                predictor_pb2_grpc.add_PredictorServicer_to_server,
                PredictorService(),  # model from MEGHA_PREDICTOR_MODEL, else the prior
                _full_name(predictor_pb2, "Predictor"),
            )
        ],
        metrics_port=config.predictor.metrics_port,
    )
    async with service:
        yield service


@contextlib.asynccontextmanager
async def running_workers(config: FederationConfig, lm_id: str | None, count: int | None):
    from services.worker.host import WorkerHost

    groups = [g for g in config.workers if lm_id is None or g.lm == lm_id]
    if lm_id is not None and not groups:  # an LM the file gives no workers: defaults
        groups = [WorkerGroup(lm=lm_id)]
    if count is not None:
        groups = [g.model_copy(update={"count": count}) for g in groups]
    for group in groups:
        if group.metrics_port:
            start_metrics(group.metrics_port)
    async with _running_hosts([WorkerHost(config, g) for g in groups]) as hosts:
        yield hosts


@contextlib.asynccontextmanager
async def running_pool_node(config: FederationConfig, pool_name: str, slot: int):
    """The node in ``slot`` of an autoscale pool (what ``megha autoscale`` starts)."""
    from services.worker.host import WorkerHost

    pool = config.pool(pool_name)
    async with _running_hosts([WorkerHost(config, pool.group(), index_offset=slot)]) as hosts:
        yield hosts


@contextlib.asynccontextmanager
async def _running_hosts(hosts: list):
    tasks = [asyncio.create_task(h.run()) for h in hosts]
    try:
        yield hosts
    finally:
        for host in hosts:
            await host.shutdown()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def until_signalled() -> None:
    """Run, once everything has started, until SIGINT or SIGTERM."""
    stalls.settle()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


@contextlib.asynccontextmanager
async def watching_stalls() -> AsyncIterator[None]:
    """``stalls.watch`` for as long as the block runs: one per process; SIGUSR1 logs
    every asyncio task and where it waits (``services.common.tasks``)."""
    install_dump()
    watcher = asyncio.create_task(stalls.watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def serve_role(
    config: FederationConfig,
    role: str,
    ident: str | None,
    count: int | None,
    pool: tuple[str, int] | None = None,
):
    """``megha gm|lm|worker|predictor``: one role until SIGINT/SIGTERM (``pool``: the
    worker is the node of that autoscale pool and slot)."""
    async with watching_stalls():
        await _serve_role(config, role, ident, count, pool)


async def _serve_role(
    config: FederationConfig,
    role: str,
    ident: str | None,
    count: int | None,
    pool: tuple[str, int] | None,
):
    if role == "predictor":
        async with running_predictor(config):
            await until_signalled()
        return
    if role == "worker":
        workers = (
            running_pool_node(config, *pool)
            if pool is not None
            else running_workers(config, ident, count)
        )
        async with workers:
            await until_signalled()
        return
    bus = role_bus(config, role)
    async with bus:
        runner = running_gm if role == "gm" else running_lm
        assert ident is not None
        async with runner(config, ident, bus):
            await until_signalled()


def role_bus(config: FederationConfig, role: str) -> Bus:
    """The bus of a GM or an LM: RabbitMQ as the role's broker user, signing what it
    queues when the federation has a queue signing key (both roles queue tasks: the LM
    its lost and preempted ones again)."""
    return make_bus(
        config.broker_url(role),
        prefix=config.exchange_prefix,
        signing_key=config.queue_signing_key(),
        queue_type=config.queue_type,
        single_active=config.queue_failover,
    )


async def serve_embedded(config: FederationConfig, ready: asyncio.Event | None = None) -> None:
    """Every service of ``config`` in this process on an in-memory bus (no RabbitMQ)."""
    broker = InMemoryBroker()
    key = config.queue_signing_key()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(watching_stalls())
        for lm in config.lms:
            bus = await stack.enter_async_context(
                make_bus(
                    "memory://", broker=broker, signing_key=key, single_active=config.queue_failover
                )
            )
            await stack.enter_async_context(running_lm(config, lm.id, bus))
        await stack.enter_async_context(running_workers(config, None, None))
        for gm in config.gms:
            bus = await stack.enter_async_context(
                make_bus(
                    "memory://", broker=broker, signing_key=key, single_active=config.queue_failover
                )
            )
            await stack.enter_async_context(running_gm(config, gm.id, bus))
        if config.predictor is not None:
            await stack.enter_async_context(running_predictor(config))
        await wait_all_healthy(config)
        if ready is not None:
            ready.set()
        await until_signalled()
