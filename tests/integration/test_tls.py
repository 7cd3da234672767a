"""A federation over mutual TLS: GM, LM, workers and the CLI as processes, real RabbitMQ."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
import yaml
from aiormq.exceptions import AMQPConnectionError

from services.common import server
from services.common.bus import RabbitBus
from services.common.client import GlobalMasterClient
from services.common.config import TlsConfig, default_config
from tests.integration.harness import Federation, container_health_check, sim_tasks
from tests.integration.tls_broker import tls_rabbitmq
from tests.tls_files import make_tls_files


@pytest.fixture
def tls(tmp_path):
    """The federation's files; this test process's own clients use them too."""
    files = make_tls_files(tmp_path / "tls")
    server.use_tls(TlsConfig(**files))
    yield files
    server.use_tls(None)


async def test_a_federation_runs_over_mutual_tls_and_refuses_other_clients(tmp_path, tls):
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2, tls=tls) as fed:
        reply = await fed.gm().submit(sim_tasks(6, 0.1))  # GM, LM and workers all on TLS
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=20)
        target = fed.config.gm("gm-1").target

        # The CLI reads the same federation file, so it speaks TLS too.
        cli = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "services.cli", "jobs", "--config", str(fed.config_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert reply.job_id in cli.stdout
        # So does the containers' health check, which reads the file without megha.
        await container_health_check(target, fed.config_path)

        # A plaintext client is refused ...
        server.use_tls(None)
        async with GlobalMasterClient(target) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await plain.jobs()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        # ... and so is one whose certificate another CA signed.
        other = make_tls_files(tmp_path / "other", ca_name="someone else")
        server.use_tls(TlsConfig(ca=tls["ca"], cert=other["cert"], key=other["key"]))
        async with GlobalMasterClient(target) as stranger:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stranger.jobs()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        server.use_tls(TlsConfig(**tls))  # for the harness's own clean-up

        # The broker URL is plain AMQP here, and every process says so.
        for name in ("gm-gm-1", "lm-lm-1"):
            assert "rabbitmq_url is amqp://" in fed.log(name)


def test_tls_files_that_cannot_be_read_stop_the_cli_with_their_name(tmp_path):
    (tmp_path / "not.pem").write_text("hello")
    config = tmp_path / "federation.yaml"

    def megha_jobs(ca: Path) -> subprocess.CompletedProcess:
        tls = {"ca": str(ca), "cert": str(tmp_path / "not.pem"), "key": "x"}
        config.write_text(yaml.safe_dump({**default_config(), "tls": tls}))
        return subprocess.run(
            [sys.executable, "-m", "services.cli", "jobs", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    missing = megha_jobs(tmp_path / "missing.pem")
    assert missing.returncode == 2
    assert f"megha: tls.ca: cannot read {tmp_path / 'missing.pem'}" in missing.stderr
    not_pem = megha_jobs(tmp_path / "not.pem")
    assert not_pem.returncode == 2
    assert f"megha: tls.ca: {tmp_path / 'not.pem'} is not a PEM file" in not_pem.stderr


# ------------------------------------------------------------------ RabbitMQ over TLS


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    """A RabbitMQ node on AMQPS only, requiring a client certificate of the test CA:
    the files, and the URL of the node."""
    directory = tmp_path_factory.mktemp("tls-broker")
    files = make_tls_files(directory / "tls")
    with tls_rabbitmq(directory / "node", files) as port:
        yield files, f"amqps://guest:guest@127.0.0.1:{port}/"


async def _round_trip(url: str) -> bytes:
    """Enqueue a message on a work queue of a fresh prefix and consume it back."""
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def on_message(delivery) -> None:
        await delivery.ack()
        if not got.done():
            got.set_result(delivery.body)

    async with asyncio.timeout(20):
        async with RabbitBus(url, prefix=f"tls-{uuid.uuid4().hex[:8]}") as bus:
            await bus.consume("q", on_message)
            await bus.enqueue("q", b"over tls")
            body = await got
            await bus.delete_queue("q")
    return body


async def test_the_bus_reaches_a_tls_broker_with_the_federations_certificate(tmp_path, tls_broker):
    files, url = tls_broker
    try:
        server.use_tls(TlsConfig(**files))
        assert await _round_trip(url) == b"over tls"
        # server_name is checked instead of the URL's host, as for gRPC ...
        server.use_tls(TlsConfig(**files, server_name="localhost"))
        assert await _round_trip(url) == b"over tls"
        server.use_tls(TlsConfig(**files, server_name="elsewhere.example"))
        with pytest.raises(AMQPConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await _round_trip(url)
        # ... and a certificate of another CA is refused by the broker.
        other = make_tls_files(tmp_path / "other", ca_name="someone else")
        server.use_tls(TlsConfig(ca=files["ca"], cert=other["cert"], key=other["key"]))
        with pytest.raises(AMQPConnectionError):
            await _round_trip(url)
        # Without the federation's TLS, the URL's own files (aiormq's query) still work;
        # with it, they are kept over the federation's.
        own = f"{url}?cafile={files['ca']}&certfile={files['cert']}&keyfile={files['key']}"
        assert await _round_trip(own) == b"over tls"
        server.use_tls(None)
        assert await _round_trip(own) == b"over tls"
        with pytest.raises(AMQPConnectionError):  # the system's CAs do not know the test CA
            await _round_trip(url)
    finally:
        server.use_tls(None)


async def test_a_federation_runs_with_its_broker_on_tls(tmp_path, tls_broker):
    files, url = tls_broker
    server.use_tls(TlsConfig(**files))
    try:
        async with Federation(
            tmp_path, gms=1, lms=1, workers_per_lm=2, tls=files, rabbitmq_url=url
        ) as fed:
            # Heartbeats, the user queue and the events all go through the TLS node.
            reply = await fed.gm().submit(sim_tasks(6, 0.1))
            await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=20)
            for name in ("gm-gm-1", "lm-lm-1"):
                assert "rabbitmq_url is amqp://" not in fed.log(name)
    finally:
        server.use_tls(None)
