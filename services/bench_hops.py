"""``megha bench hops``: what one message between two processes costs on this host.

Every task crosses three gRPC hops before it starts (client → GM, GM → LM, LM → worker),
so their floor bounds the allocation time. This measures it outside the scheduler: a
server in a child process, a client here, the same message each way, paced at a rate (a
busy federation's processes are woken for each message, not kept spinning) or back to
back. Four transports:

- ``tcp``: an asyncio TCP echo, length-prefixed: the floor without gRPC;
- ``unary``: a grpc.aio unary call per message (what ``SubmitJob`` costs);
- ``stream``: a message each way on one grpc.aio bidirectional stream (``SubmitStream``,
  ``LaunchStream``, the worker streams);

and reports the round trip (p50/p99) and the CPU per round trip of the client and of the
server process (getrusage / /proc, so including gRPC's own threads).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import queue
import resource
import struct
import time
from dataclasses import asdict, dataclass

import grpc

from services._proto.megha.v1 import common_pb2

_SERVICE = "megha.bench.Echo"
_TASK = common_pb2.Task(task_id="j.0", job_id="j", queue="default")  # a typical small message
_TASK.resources.cpu_milli = 1000
_TASK.resources.memory_mb = 64
_TASK.sim.duration_s = 0.05


@dataclass
class HopResult:
    transport: str
    rate: float  # round trips per second offered; 0 = back to back
    round_trips: int
    rtt_p50_ms: float
    rtt_p99_ms: float
    client_cpu_us: float  # per round trip
    server_cpu_us: float


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the server process
async def _serve(ports) -> None:
    """Echo over gRPC (unary and stream) and TCP on ports the kernel picks; their
    numbers go back on ``ports`` (a queue) once both listen."""

    async def unary(request, context):
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = struct.unpack("!I", await reader.readexactly(4))
                writer.write(struct.pack("!I", size) + await reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    parse, dump = common_pb2.Task.FromString, common_pb2.Task.SerializeToString
    handler = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, parse, dump),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, parse, dump),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tcp = await asyncio.start_server(echo, "127.0.0.1", 0)
    ports.put((grpc_port, tcp.sockets[0].getsockname()[1]))
    async with tcp:
        await server.wait_for_termination()


def _server_main(ports) -> None:
    asyncio.run(_serve(ports))


# ------------------------------------------------------------------ the client
async def _measure(
    transport: str, grpc_port: int, tcp_port: int, server_pid: int, rate: float, count: int
) -> HopResult:
    body = _TASK.SerializeToString()
    if transport == "tcp":
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        frame = struct.pack("!I", len(body)) + body

        async def once() -> None:
            writer.write(frame)
            (size,) = struct.unpack("!I", await reader.readexactly(4))
            common_pb2.Task.FromString(await reader.readexactly(size))

        close = writer.close
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        dump, parse = common_pb2.Task.SerializeToString, common_pb2.Task.FromString
        if transport == "unary":
            call = channel.unary_unary(f"/{_SERVICE}/Unary", dump, parse)

            async def once() -> None:
                await call(_TASK)

        else:
            streaming = channel.stream_stream(f"/{_SERVICE}/Stream", dump, parse)()

            async def once() -> None:
                await streaming.write(_TASK)
                await streaming.read()

        def close() -> None:
            pass

    for _ in range(50):  # warm up: connection, HTTP/2 settings, code paths
        await once()
    rtts: list[float] = []
    cpu, server_cpu = _cpu_self(), _cpu_of(server_pid)
    gap = 1.0 / rate if rate > 0 else 0.0
    next_at = time.perf_counter()
    for _ in range(count):
        began = time.perf_counter()
        await once()
        rtts.append(time.perf_counter() - began)
        if gap:
            next_at += gap
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    client_cpu, server_cpu = _cpu_self() - cpu, _cpu_of(server_pid) - server_cpu
    close()
    if transport != "tcp":
        await channel.close()
    rtts.sort()
    return HopResult(
        transport=transport,
        rate=rate,
        round_trips=count,
        rtt_p50_ms=round(rtts[len(rtts) // 2] * 1e3, 3),
        rtt_p99_ms=round(rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] * 1e3, 3),
        client_cpu_us=round(client_cpu / count * 1e6, 1),
        server_cpu_us=round(server_cpu / count * 1e6, 1),
    )


def bench_hops(rates: tuple[float, ...] = (200.0, 0.0), count: int = 2000) -> list[HopResult]:
    context = multiprocessing.get_context("spawn")  # no gRPC state inherited by a fork
    ports = context.Queue()
    server = context.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    try:
        try:
            grpc_port, tcp_port = ports.get(timeout=30)
        except queue.Empty:
            raise RuntimeError("the echo server did not start") from None
        assert server.pid is not None
        results = []
        for rate in rates:
            for transport in ("tcp", "unary", "stream"):
                results.append(
                    asyncio.run(_measure(transport, grpc_port, tcp_port, server.pid, rate, count))
                )
        return results
    finally:
        server.terminate()
        server.join(10)


def render_hops(results: list[HopResult], as_json: bool) -> str:
    if as_json:
        return json.dumps([asdict(r) for r in results], indent=2)
    lines = [
        "transport  rate/s   RTT p50 ms  RTT p99 ms  client CPU us  server CPU us",
    ]
    for r in results:
        rate = f"{r.rate:g}" if r.rate else "b2b"
        lines.append(
            f"{r.transport:<9}  {rate:>6}  {r.rtt_p50_ms:>10.3f}  {r.rtt_p99_ms:>10.3f}  "
            f"{r.client_cpu_us:>13.0f}  {r.server_cpu_us:>13.0f}"
        )
    lines.append(
        "(one message each way between two processes on loopback; b2b = back to back; CPU "
        "per round trip, gRPC's threads included)"
    )
    return "\n".join(lines)
