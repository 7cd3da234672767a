"""The compose ``loadgen`` service: wait until the GMs see workers, then replay a trace.

``python replay.py TRACE [megha-loadgen replay options]`` waits until every GM of the
federation file sees every LM with workers (a job submitted before that would find no
node), then runs ``megha-loadgen replay TRACE --gm <every GM of the file> ...``, which
prints the report and exits 0 when every task completed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import grpc

from services.common.client import GlobalMasterClient
from services.common.config import ConfigError, FederationConfig, load_config
from services.common.server import TlsError, use_tls

READY_TIMEOUT_S = float(os.environ.get("MEGHA_READY_TIMEOUT_S", "120"))


async def wait_for_workers(config: FederationConfig, timeout_s: float) -> None:
    """Every GM sees every LM with at least one worker (worker counts come from the worker
    containers' command lines, not from the file, so they are not awaited exactly)."""
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
                    raise SystemExit(f"replay: GM {gm.id} sees {seen} after {timeout_s:.0f} s")
                await asyncio.sleep(0.5)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: replay.py TRACE [megha-loadgen replay options]", file=sys.stderr)
        return 2
    try:
        config = load_config(os.environ.get("MEGHA_CONFIG"))
        use_tls(config.tls)
    except (ConfigError, TlsError) as err:
        print(f"replay: {err}", file=sys.stderr)
        return 2
    asyncio.run(wait_for_workers(config, READY_TIMEOUT_S))
    if "--gm" not in argv:
        argv = [*argv, "--gm", ",".join(g.target for g in config.gms)]
    if config.tls is not None and "--config" not in argv and os.environ.get("MEGHA_CONFIG"):
        argv = [*argv, "--config", os.environ["MEGHA_CONFIG"]]
    sys.stdout.flush()
    os.execvp("megha-loadgen", ["megha-loadgen", "replay", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
