"""Child processes of ``megha up`` and of the live benchmarks: a federation started as
one process per role, watched, restarted, stopped.

    config ──write_federation──▶ log_dir/federation.yaml
           ──start_federation──▶ Children: lm-*, predictor, gm-*, workers-*, autoscale
    Children.guard(coro) ──a child exits──▶ restart it (up to MAX_RESTARTS a window)
                                          ──or──▶ ChildDied with the tail of its log
    wait_until_ready: every GM has heard from every LM and sees every configured worker
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

import yaml

from services.common.client import GlobalMasterClient
from services.common.config import FederationConfig, split_urls


def amqp_port(url: str) -> int:
    """The port of a broker URL, or AMQP's default for its scheme (5671 for amqps)."""
    parsed = urlparse(url)
    return parsed.port or (5671 if parsed.scheme == "amqps" else 5672)


def broker_reachable(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a broker listens at ``url`` (at any node, when it lists several)."""
    if url.startswith("memory://"):
        return True
    if "," in url:
        return any(broker_reachable(node, timeout_s) for node in split_urls(url))
    parsed = urlparse(url)
    import socket

    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", amqp_port(url)), timeout_s):
            return True
    except OSError:
        return False


def write_federation(config: FederationConfig, log_dir: Path) -> tuple[FederationConfig, Path]:
    """``config`` as ``megha up`` runs it (each LM's journal in ``log_dir``, and the
    tasks' output under it), written to ``log_dir/federation.yaml`` for the children;
    the config and its path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    config = config.with_journals(log_dir)
    if not config.worker_output_dir:
        config = config.model_copy(update={"worker_output_dir": str(log_dir / "output")})
    config_path = log_dir / "federation.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return config, config_path


def start_federation(
    config: FederationConfig, config_path: Path, children: Children, extra: Sequence[str] = ()
) -> None:
    """Start every role of ``config`` as a child process, LMs first, with ``extra``
    arguments (e.g. ``--log-level``). Names: ``lm-<id>``, ``gm-<id>``, ``workers-<lm id>``,
    ``predictor``, ``autoscale`` (with an ``autoscale`` section); logs in the children's
    log dir."""
    base = [sys.executable, "-m", "services.cli"]
    conf = ["--config", str(config_path), *extra]
    for lm in config.lms:
        children.start(f"lm-{lm.id}", [*base, "lm", "--id", lm.id, *conf])
    if config.predictor is not None:
        children.start("predictor", [*base, "predictor", *conf])
    for gm in config.gms:
        children.start(f"gm-{gm.id}", [*base, "gm", "--id", gm.id, *conf])
    for lm in config.lms:
        if any(g.lm == lm.id for g in config.workers):
            children.start(f"workers-{lm.id}", [*base, "worker", "--lm", lm.id, *conf])
    if config.autoscale is not None:  # its nodes' logs beside the others
        children.start("autoscale", [*base, "autoscale", *conf, "--log-dir", str(children.log_dir)])


class ChildDied(RuntimeError):
    pass


# A child of ``megha up`` that exits is started again, up to this many times a window.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class Children:
    """Child processes with their logs; a dead child aborts what ``guard`` waits for."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.restarts: dict[str, deque[float]] = defaultdict(deque)  # when, per child

    def start(self, name: str, argv: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (lives with the child)
        self.argv[name] = argv
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop one child abruptly (``kill -9`` by default), as a crash would."""
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(10)

    def restart(self, name: str) -> None:
        self.start(name, self.argv[name])

    def crash(self, names: list[str] | None = None) -> list[str]:
        """Kill (-9) the named children, every one by default, all before any starts
        again (a host or a whole federation going down), then restart them; the names."""
        names = sorted(self.procs) if names is None else names
        for name in names:
            self.kill(name)
        for name in names:
            self.restart(name)
        return names

    async def guard(self, coro, restart: bool = False):
        """Await ``coro``; a child that exits meanwhile aborts it with ``ChildDied``, or,
        with ``restart``, is started again (as compose's ``restart: unless-stopped``
        would; every role recovers from a restart) unless it exits for the
        ``MAX_RESTARTS + 1``-th time within ``RESTART_WINDOW_S``: a crash loop."""
        task = asyncio.ensure_future(coro)
        while not task.done():
            await asyncio.wait({task}, timeout=0.2)
            for name, proc in list(self.procs.items()):
                if proc.poll() is None or task.done():
                    continue
                if restart and self._may_restart(name):
                    print(
                        f"megha: {name} exited with {proc.returncode}; restarting it "
                        f"(log {self.log_dir / f'{name}.log'})",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.restart(name)
                    continue
                task.cancel()
                why = f"{name} exited with {proc.returncode}"
                if restart:
                    why += f", restarted {MAX_RESTARTS} times in {RESTART_WINDOW_S:g} s already"
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-1500:]
                raise ChildDied(f"{why}:\n{tail}")
        return task.result()

    def _may_restart(self, name: str) -> bool:
        times = self.restarts[name]
        now = time.monotonic()
        while times and now - times[0] > RESTART_WINDOW_S:
            times.popleft()
        if len(times) >= MAX_RESTARTS:
            return False
        times.append(now)
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_until_ready(config: FederationConfig, timeout_s: float = 60.0) -> None:
    """Every GM has heard from every LM, and every configured worker has registered."""
    expected = {lm.id: 0 for lm in config.lms}
    for group in config.workers:
        expected[group.lm] += group.count
    deadline = time.monotonic() + timeout_s
    for gm in config.gms:
        async with GlobalMasterClient(gm.target) as client:
            while True:
                view = await client.cluster()
                seen = {lm.lm_id: sum(p.node_count for p in lm.partitions) for lm in view.lms}
                if all(seen.get(lm, -1) >= n for lm, n in expected.items()):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"GM {gm.id} sees {seen}, expected {expected}")
                await asyncio.sleep(0.2)
