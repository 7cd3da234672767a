"""Probe a gray failure: the GM cannot reach one LM (its packets are dropped), while that
LM's heartbeats still reach the GM through RabbitMQ and its workers are fine.

Starts a private federation (1 GM, 2 LMs) with the harness of the integration tests,
points the GM at lm-1 through 127.0.0.3, drops that traffic with iptables (root only),
submits --tasks short tasks in 10 waves a second apart and prints how long they took and
where they ran. Run it from the repository root, with RabbitMQ up:

    python scripts/probe_unreachable_lm.py --tasks 160            # the partition
    python scripts/probe_unreachable_lm.py --tasks 160 --no-drop  # the same, reachable
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness is in tests/

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
DETOUR = "127.0.0.3"  # the address the GM dials lm-1 at; the workers keep 127.0.0.1


async def probe(drop: bool, tasks: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="probe-unreachable-"))
    async with Federation(tmp, gms=1, lms=2, workers_per_lm=4) as fed:
        port = fed.config.lm("lm-1").port
        data = yaml.safe_load(fed.config_path.read_text())
        for lm in data["lms"]:
            if lm["id"] == "lm-1":
                lm["host"], lm["bind"] = DETOUR, "0.0.0.0"
        detour = tmp / "detour.yaml"
        detour.write_text(yaml.safe_dump(data))
        for name in (
            "lm-lm-1",
            "gm-gm-1",
        ):  # lm-1 listens on every address, the GM dials the detour
            argv = [
                str(detour) if a == str(fed.config_path) else a for a in fed.children.argv[name]
            ]
            fed.children.kill(name)
            fed.children.start(name, argv)
        await asyncio.sleep(4)
        rule = ["OUTPUT", "-d", DETOUR, "-p", "tcp", "--dport", str(port), "-j", "DROP"]
        if drop:
            subprocess.run(["iptables", "-I", *rule], check=True)
        try:
            for _ in range(100):
                try:
                    await fed.gm().cluster()
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            await asyncio.sleep(2)
            began = time.monotonic()
            ids: set[str] = set()
            for _ in range(10):
                reply = await fed.gm().submit(sim_tasks(tasks // 10, 0.2))
                ids |= set(reply.task_ids)
                await asyncio.sleep(1.0)
            await fed.events.wait_succeeded(ids, timeout_s=120)
            took = time.monotonic() - began
        finally:
            if drop:
                subprocess.run(["iptables", "-D", *rule], check=True)
        ended = [e for e in fed.events.events if e.state == SUCCEEDED and e.task_id in ids]
        spans = sorted(
            (e.timestamps.finished_unix_nanos - e.timestamps.submitted_unix_nanos) / 1e9
            for e in ended
        )
        print(f"lm-1 unreachable from the GM: {drop}")
        print(f"  {len(ids)} tasks in {took:.1f} s, by LM {dict(Counter(e.lm_id for e in ended))}")
        print(
            f"  submit to finish: p50 {spans[len(spans) // 2]:.2f} s, max {spans[-1]:.2f} s, "
            f"{sum(s > 2 for s in spans)} over 2 s"
        )
        print(f"  GM launches that failed: {fed.log('gm-gm-1').count('launch failed')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=160)
    parser.add_argument("--no-drop", action="store_true", help="leave lm-1 reachable")
    args = parser.parse_args()
    asyncio.run(probe(not args.no_drop, args.tasks))


if __name__ == "__main__":
    main()
