"""How long a gRPC client takes to reach a server again after it was down for a while.

Runs, side by side, a bare channel (gRPC's default reconnect backoff, growing to 120 s) and
one with Megha's ``CHANNEL_OPTIONS`` (capped at 2 s). Each polls a health server that is
down for ``--down`` seconds, then measures how long after the server's return its next
call succeeds. The bare channel's figure depends on where its backoff schedule happens to
be, so it varies from run to run; the capped one stays within one cap plus one poll.

    python scripts/reconnect_backoff.py --down 40 --poll 0.1 0.5 3
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.server import CHANNEL_OPTIONS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _back_after(options: list, down_s: float, poll_s: float) -> float:
    port = _free_port()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    stub = health_pb2_grpc.HealthStub(channel)
    began = time.monotonic()
    server = None
    back_at = 0.0
    try:
        while True:
            if server is None and time.monotonic() - began >= down_s:
                server = grpc.aio.server()
                health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
                server.add_insecure_port(f"127.0.0.1:{port}")
                await server.start()
                back_at = time.monotonic()
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                pass
            else:
                if server is not None:
                    return time.monotonic() - back_at
            await asyncio.sleep(poll_s)
    finally:
        await channel.close()
        if server is not None:
            await server.stop(None)


async def _main(down_s: float, polls: list[float]) -> None:
    runs = [
        (name, options, poll)
        for poll in polls
        for name, options in (("default", []), ("capped", CHANNEL_OPTIONS))
    ]
    results = await asyncio.gather(*(_back_after(o, down_s, p) for _, o, p in runs))
    print(f"server down {down_s:g} s; time from its return to the first successful call")
    for (name, _, poll), seconds in zip(runs, results, strict=True):
        print(f"  {name:<8} poll every {poll:>4g} s: {seconds:6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down", type=float, default=40.0, help="seconds the server is down")
    parser.add_argument(
        "--poll",
        type=float,
        nargs="+",
        default=[0.1, 0.5, 3.0],
        help="seconds between the client's calls (one pair of runs per value)",
    )
    args = parser.parse_args()
    asyncio.run(_main(args.down, args.poll))


if __name__ == "__main__":
    main()
