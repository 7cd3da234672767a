"""The broker as part of the trust boundary (docs/security.md, "The broker"): per-role
RabbitMQ users made by ``megha broker-users``, and GMs that run only signed work.

Each test gets its own vhost and user names, made with rabbitmqctl and deleted after;
the broker's ``guest`` user and default vhost are left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import secrets
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import aio_pika
import aiormq
import pytest
import yaml

from services import cli
from services._proto.megha.v1 import common_pb2
from services.app.broker_users import broker_users
from services.common.bus import RabbitBus
from services.common.config import parse_config
from services.common.names import EVENT_EXCHANGE, EVERY_TASK_EVENT, user_queue
from services.common.queue_signing import SIGNATURE_HEADER, sign
from tests.integration.harness import (
    RABBITMQ_URL,
    Events,
    Federation,
    job_in_state,
    shell_task,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl"),
]

QUEUE = "q1"
NODE = os.environ.get("MEGHA_TEST_RABBITMQ_NODE")


def _ctl(*args: str, stdin: str | None = None) -> None:
    where = ["-n", NODE] if NODE else []
    subprocess.run(
        ["rabbitmqctl", *where, *args], input=stdin, text=True, check=True, capture_output=True
    )


@pytest.fixture
def broker_section(tmp_path: Path):
    """A fresh vhost with the federation's role users (made by ``broker_users``) and an
    admin user for the test's own tools; yields (rabbitmq_url, broker section, tag)."""
    tag = uuid.uuid4().hex[:10]
    vhost = f"megha-test-{tag}"
    admin, admin_pw = f"megha-test-admin-{tag}", secrets.token_urlsafe(16)
    host = urlsplit(RABBITMQ_URL).netloc.rpartition("@")[2]
    url = f"amqp://{admin}:{admin_pw}@{host}/{vhost}"
    section = {
        role: {"name": f"megha-test-{role}-{tag}", "password_file": str(tmp_path / f"{role}.pw")}
        for role in ("gm", "lm", "reader")
    }
    section["queue_signing_key"] = str(tmp_path / "queue.key")
    users = [admin, *(section[r]["name"] for r in ("gm", "lm", "reader"))]
    try:
        yield url, section, tag
    finally:
        subprocess.run(["rabbitmqctl", "delete_vhost", vhost], capture_output=True)
        for user in users:
            subprocess.run(["rabbitmqctl", "delete_user", user], capture_output=True)


def _config_data(url: str, section: dict, prefix: str) -> dict:
    return {
        "rabbitmq_url": url,
        "exchange_prefix": prefix,
        "gms": [{"id": "gm-1", "port": 1}],
        "lms": [{"id": "lm-1", "port": 2}],
        "queues": [{"name": QUEUE, "gm": "gm-1"}],
        "broker": section,
    }


def _make_users(url: str, section: dict, prefix: str, tmp_path: Path | None = None) -> str:
    """``megha broker-users`` for the section (through the CLI with ``tmp_path`` for its
    file, else the library call), then the test's admin user on the vhost."""
    data = _config_data(url, section, prefix)
    config = parse_config(data, env={})
    if tmp_path is None:
        done = "\n".join(broker_users(config))
    else:
        path = tmp_path / "federation.yaml"
        path.write_text(yaml.safe_dump(data))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["broker-users", "--config", str(path)]) == 0
        done = out.getvalue()
    parts = urlsplit(url)
    _ctl("add_user", parts.username, stdin=parts.password)
    _ctl("set_permissions", "-p", config.broker_vhost, parts.username, ".*", ".*", ".*")
    return done


def _batch(job_id: str, marker: Path) -> bytes:
    task = shell_task(f"touch {marker}")
    task.task_id, task.job_id, task.queue = f"{job_id}-0", job_id, QUEUE
    return common_pb2.TaskBatch(job_id=job_id, queue=QUEUE, tasks=[task]).SerializeToString()


async def test_only_gms_may_read_user_queues_and_readers_may_not_write_to_them(
    tmp_path, broker_section
):
    url, section, tag = broker_section
    prefix = f"bt-{tag}"
    done = _make_users(url, section, prefix, tmp_path)
    assert f"added gm user megha-test-gm-{tag}" in done
    assert "made queue signing key" in done
    assert (tmp_path / "gm.pw").stat().st_mode & 0o777 == 0o600
    config = parse_config(_config_data(url, section, prefix), env={})
    queue_name = f"{prefix}.queue.user.{QUEUE}"

    # A GM declares its queue (as it does at start) and may consume it.
    gm = await aio_pika.connect(config.broker_url("gm"))
    async with gm:
        channel = await gm.channel()
        queue = await channel.declare_queue(queue_name, durable=True)
        await queue.consume(_ignore)

    # A reader (the load generator) hears events, but publishing into a user queue is
    # refused by RabbitMQ: it has no write on the default exchange.
    reader = await aio_pika.connect(config.broker_url("reader"))
    async with reader:
        events = Events()
        bus = RabbitBus(config.broker_url("reader"), prefix=prefix)
        async with bus:
            await bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, events.on_batch)
        channel = await reader.channel(publisher_confirms=True)
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match=r"amq\.default"):
            await channel.default_exchange.publish(
                aio_pika.Message(_batch("forged", tmp_path / "x")), queue_name
            )

    # An LM may queue tasks again, but never take work from a user queue.
    lm = await aio_pika.connect(config.broker_url("lm"))
    async with lm:
        channel = await lm.channel()
        queue = await channel.declare_queue(queue_name, durable=True)
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match=queue_name):
            await queue.consume(_ignore)

    # guest was given nothing on the federation's vhost: the broker closes the connection.
    guest = urlsplit(RABBITMQ_URL)
    with pytest.raises(aiormq.exceptions.AMQPError, match=r"Connection\.Close"):
        await aio_pika.connect(f"amqp://{guest.netloc}/{config.broker_vhost}")


def _federation(tmp_path: Path, url: str, section: dict) -> Federation:
    """One GM, one LM with one worker, connected as their broker users (made here)."""
    fed = Federation(
        tmp_path,
        gms=1,
        lms=1,
        workers_per_lm=1,
        queues=[{"name": QUEUE, "gm": "gm-1"}],
        metrics=True,
        rabbitmq_url=url,
        broker=section,
    )
    _make_users(url, section, fed.prefix)
    return fed


async def test_a_gm_drops_unsigned_and_badly_signed_work_and_runs_signed_work(
    tmp_path, task_tmp, broker_section
):
    """The tester's attack: a TaskBatch published straight into a user queue (here by
    the GM's own broker user, so the broker lets it in) ran on a worker. Now the GM drops
    it unread, says so, counts it; a message signed with the federation's key runs."""
    url, section, _ = broker_section
    fed = _federation(tmp_path, url, section)
    async with fed:
        config = fed.config
        queue_name = fed.bus.queue_name(user_queue(QUEUE))
        forged = [task_tmp / "unsigned-ran", task_tmp / "wrong-key-ran"]
        connection = await aio_pika.connect(config.broker_url("gm"))
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            body = _batch("unsigned", forged[0])
            await channel.default_exchange.publish(
                aio_pika.Message(body, message_id="forged-1"), queue_name
            )
            body = _batch("wrong-key", forged[1])
            bad = sign(b"not the federation's key, 32 bytes", queue_name, body)
            await channel.default_exchange.publish(
                aio_pika.Message(body, headers={SIGNATURE_HEADER: bad}, message_id="forged-2"),
                queue_name,
            )
        deadline = time.monotonic() + 20
        name = "megha_gm_unauthenticated_messages_total"
        while await fed.metric("gm-1", name) < 2:
            assert time.monotonic() < deadline, "the GM never dropped the forged messages"
            await asyncio.sleep(0.1)

        # Signed with the federation's key (as a GM or an LM signs), a message runs.
        signed = task_tmp / "signed-ran"
        bus = RabbitBus(
            config.broker_url("gm"), prefix=fed.prefix, signing_key=config.queue_signing_key()
        )
        async with bus:
            await bus.enqueue(user_queue(QUEUE), _batch("signed", signed))
        await fed.events.wait_succeeded({"signed-0"}, timeout_s=30)
        assert signed.exists()

        # A failed attempt's retry is queued by the LM, signed with the same key: it runs.
        reply = await fed.gm().submit([shell_task("exit 1", retries=1)], job_id="retried")
        job = await job_in_state(fed.gm(), reply.job_id, common_pb2.TASK_STATE_FAILED)
        assert job.tasks[0].attempt == 1

        log = fed.log("gm-gm-1")
        assert f"signature from {queue_name} (message id 'forged-1')" in log
        assert f"signature from {queue_name} (message id 'forged-2')" in log
        assert not any(path.exists() for path in forged)
        seen = {e.task_id for e in fed.events.events}
        assert not seen & {"unsigned-0", "wrong-key-0"}, seen
        assert await fed.metric("gm-1", name) == 2
        assert await fed.bus.queue_depth(user_queue(QUEUE)) == 0  # dropped, not requeued


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    pass


async def test_with_task_seals_an_lm_cannot_forge_work_but_its_retries_run(
    tmp_path, task_tmp, broker_section
):
    """LMs hold the queue key (they re-queue lost tasks), so a message an LM signs gets
    past the signature check. With ``task_seal_key`` (GMs only) each task must carry the
    seal of the GM that accepted it: an LM's own new work is dropped, its retries run."""
    url, section, _ = broker_section
    section["task_seal_key"] = str(tmp_path / "seal.key")
    fed = _federation(tmp_path, url, section)
    async with fed:
        config = fed.config
        forged = task_tmp / "lm-forged-ran"
        lm_bus = RabbitBus(
            config.broker_url("lm"), prefix=fed.prefix, signing_key=config.queue_signing_key()
        )
        async with lm_bus:  # what a compromised LM host could do: sign a task of its own
            await lm_bus.enqueue(user_queue(QUEUE), _batch("lm-forged", forged))
        deadline = time.monotonic() + 20
        name = "megha_gm_unauthenticated_messages_total"
        while await fed.metric("gm-1", name) < 1:
            assert time.monotonic() < deadline, "the GM never dropped the unsealed task"
            await asyncio.sleep(0.1)

        # A task a client submitted is sealed by the GM; its retry, queued by the LM, runs.
        reply = await fed.gm().submit([shell_task("exit 1", retries=1)], job_id="retried")
        job = await job_in_state(fed.gm(), reply.job_id, common_pb2.TASK_STATE_FAILED)
        assert job.tasks[0].attempt == 1
        assert "with a task whose seal does not hold" in fed.log("gm-gm-1")
        assert not forged.exists()
        assert "lm-forged-0" not in {e.task_id for e in fed.events.events}
        assert await fed.metric("gm-1", name) == 1
