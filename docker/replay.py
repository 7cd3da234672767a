"""The compose ``loadgen`` service: replay a trace against the running GMs, print the report.

What ``megha up --replay`` does once it has started its own federation, here against the
containers of docker-compose.yml (the federation file names the GMs and the queues).
Exit 0 when every task completed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import grpc

from loadgen.replay import replay_trace
from services.client import GlobalMasterClient
from services.common.config import ConfigError, FederationConfig, load_config


async def wait_for_workers(config: FederationConfig, timeout_s: float) -> None:
    """Every GM sees every LM with at least one worker (the counts come from the command
    lines of the worker containers, not the file, so they are not awaited exactly)."""
    deadline = time.monotonic() + timeout_s
    for gm in config.gms:
        async with GlobalMasterClient(gm.target) as client:
            while True:
                try:
                    view = await client.cluster()
                    seen = {lm.lm_id: sum(p.node_count for p in lm.partitions) for lm in view.lms}
                    if all(seen.get(lm.id, 0) > 0 for lm in config.lms):
                        break
                except grpc.aio.AioRpcError as err:  # not up yet: retried until the deadline
                    seen = {"error": err.code().name}
                if time.monotonic() > deadline:
                    raise TimeoutError(f"GM {gm.id} sees {seen} after {timeout_s:.0f} s")
                await asyncio.sleep(0.5)


async def run(args: argparse.Namespace, config: FederationConfig) -> int:
    await wait_for_workers(config, args.ready_timeout)
    report = await replay_trace(
        args.trace,
        [g.target for g in config.gms],
        speedup=args.speedup,
        max_jobs=args.max_jobs,
        queues=[q.name for q in config.effective_queues()],
    )
    print(report.render(), flush=True)
    return 0 if report.completed == report.tasks else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="replay", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.environ.get("MEGHA_CONFIG"))
    parser.add_argument("--trace", default=os.environ.get("MEGHA_TRACE", "/traces/trace.tr"))
    parser.add_argument("--max-jobs", type=int, default=10, help="jobs to replay")
    parser.add_argument("--speedup", type=float, default=20000.0, help="compress time by this")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"replay: {err}", file=sys.stderr)
        return 2
    return asyncio.run(run(args, config))


if __name__ == "__main__":
    sys.exit(main())
