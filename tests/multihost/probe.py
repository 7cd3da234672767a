"""What the multi-host test runs inside a namespace (the root namespace is not on the
hosts' subnet, and a loopback federation is reachable only from its own namespace).

    python -m tests.multihost.probe ready FEDERATION_FILE
        every GM and LM answers gRPC health, every GM sees every LM and worker
    python -m tests.multihost.probe record FEDERATION_FILE OUT
        every task event of the federation, as any subscriber of the events exchange sees
        them, appended to OUT (4-byte big-endian length + a TaskEventBatch) until SIGTERM
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import struct
import sys
from pathlib import Path

from services.app.supervisor import wait_until_ready
from services.common.bus import RabbitBus
from services.common.config import load_config
from services.common.names import EVENT_EXCHANGE, EVERY_TASK_EVENT
from services.common.server import wait_all_healthy


async def ready(path: str) -> None:
    config = load_config(path, env={})
    await wait_all_healthy(config, timeout_s=60)
    await wait_until_ready(config, timeout_s=60)


async def record(path: str, out: str) -> None:
    config = load_config(path, env={})
    bus = RabbitBus(config.broker_url("reader"), prefix=config.exchange_prefix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    with Path(out).open("ab") as sink:

        async def on_batch(_key: str, body: bytes) -> None:
            sink.write(struct.pack(">I", len(body)) + body)
            sink.flush()

        await bus.connect()
        await bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, on_batch)
        Path(out + ".ready").touch()
        await stop.wait()
        with contextlib.suppress(Exception):
            await bus.close()


def main(argv: list[str]) -> None:
    command, *args = argv
    run = {"ready": ready, "record": record}[command]
    asyncio.run(run(*args))


if __name__ == "__main__":
    main(sys.argv[1:])
