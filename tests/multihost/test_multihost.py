"""Multi-host, for real (issue #30 item 3): every GM, LM, worker host and the RabbitMQ node
in its own network namespace with its own address, nothing shared but the federation file.

    client 10.77.0.100 ── megha-loadgen replay, event recorder
    broker 10.77.0.2   ── RabbitMQ (rabbit@localhost, private to the namespace)
    gm-1 .11  gm-2 .12 ── megha gm        (both on port 7000: another host, another address)
    lm-1 .21  lm-2 .22 ── megha lm        (each its own journal on its own disk)
    w-lm-1 .31  w-lm-2 .32 ── megha worker (8 sim nodes each; advertise their address)

The same 300-job replay runs first with every role in one namespace on 127.0.0.1 (the
loopback baseline, broker included), then across the hosts; the allocation-time p50s are
printed and the multi-host one must be within 2x. A second replay, with queue failover
on (``queue_failover``; AMQP heartbeats of ``BROKER_HEARTBEAT_S``), cuts gm-2's link for
a few seconds: the broker drops gm-2's connection when its heartbeats stop, hands gm-2's
queue to gm-1 (single active consumer), and gm-1 serves it while the link is down; every
acknowledged task ends, none starts or succeeds twice (an independent recorder of the
events exchange checks), once gm-2 is back too (its late launches are fenced).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import pytest

from loadgen.invariants import check
from services._proto.megha.v1 import common_pb2
from tests.multihost.netns import Host, Network, why_unavailable
from tests.multihost.roles import (
    AMQP_PORT,
    RABBITMQ_SERVER,
    megha,
    probe,
    replay,
    role_env,
    start_rabbitmq,
    write_federation,
)

pytestmark = [pytest.mark.integration, pytest.mark.multihost]

JOBS = 300
SPACING_S = 0.08  # 300 jobs over 24 s
TASK_S = 1.0  # about 13 tasks run at once on 64 CPUs: no task waits for a node
WORKERS_PER_LM = 8
GM_PORT, LM_PORT, WORKER_METRICS = 7000, 7100, 9100
CUT_AT_S, CUT_FOR_S = 6.0, 8.0
BROKER_HEARTBEAT_S = 2  # AMQP heartbeat: RabbitMQ drops a silent connection after ~2 of them
REPLAY_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def net():
    why = why_unavailable()
    if why:
        pytest.skip(f"multi-host test: {why}")
    if not RABBITMQ_SERVER.exists():
        pytest.skip(f"multi-host test: {RABBITMQ_SERVER} is not installed")
    # Not under pytest's tmp_path (mode 0700): worker hosts of a root run run their tasks
    # as nobody, in directories under their TMPDIR.
    root = Path(tempfile.mkdtemp(prefix="megha-netns-"))
    root.chmod(0o711)
    network = Network(root)
    try:
        network.add("broker", 2)
        network.add("client", 100)
        for i in (1, 2):
            network.add(f"gm-{i}", 10 + i)
            network.add(f"lm-{i}", 20 + i)
            network.add(f"w-lm-{i}", 30 + i)
        start_rabbitmq(network.hosts["broker"])
        yield network
    finally:
        network.close()
        if os.environ.get("MEGHA_NETNS_KEEP") == "1":
            print(f"\nhosts' directories and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def write_trace(path: Path) -> Path:
    """``.tr``: arrival, task count, mean duration, durations."""
    path.write_text("".join(f"{j * SPACING_S:.3f} 1 {TASK_S} {TASK_S}\n" for j in range(JOBS)))
    return path


def federation(
    prefix: str, broker: str, hosts: dict[str, str], dirs: dict[str, Path], failover: bool
) -> dict:
    """The federation file: ``hosts`` gives each role's address (all 127.0.0.1 for the
    loopback baseline, whose ports then differ), ``dirs`` each LM's own directory;
    ``failover``: queue failover, and AMQP heartbeats short enough to notice a cut."""
    one_host = len(set(hosts.values())) == 1
    step = 1 if one_host else 0
    query = f"?heartbeat={BROKER_HEARTBEAT_S}" if failover else ""
    return {
        "rabbitmq_url": f"amqp://guest:guest@{broker}:{AMQP_PORT}/{query}",
        "queue_failover": failover,
        "exchange_prefix": prefix,
        "heartbeat_interval_s": 0.5,
        "worker_heartbeat_interval_s": 1.0,
        "gms": [
            {"id": f"gm-{i}", "host": hosts[f"gm-{i}"], "port": GM_PORT + i * step} for i in (1, 2)
        ],
        "lms": [
            {
                "id": f"lm-{i}",
                "host": hosts[f"lm-{i}"],
                "port": LM_PORT + i * step,
                "journal": str(dirs[f"lm-{i}"] / f"lm-{i}.journal"),
            }
            for i in (1, 2)
        ],
        "workers": [
            {
                "lm": f"lm-{i}",
                "count": WORKERS_PER_LM,
                "capacity": "cpu=4,mem=8Gi",
                "metrics_port": WORKER_METRICS + i * step,
                # lm-1's worker host is named here; lm-2's says it in MEGHA_ADVERTISE_HOST.
                **({"host": hosts["w-lm-1"]} if i == 1 and not one_host else {}),
            }
            for i in (1, 2)
        ],
        "queues": [
            {"name": "q1", "share": 0.5, "gm": "gm-1"},
            {"name": "q2", "share": 0.5, "gm": "gm-2"},
        ],
    }


class Run:
    """One federation on ``placement`` (role -> host) and its replays from ``client``."""

    def __init__(
        self,
        net: Network,
        label: str,
        placement: dict[str, Host],
        client: Host,
        failover: bool = False,
    ):
        self.net, self.label, self.client = net, label, client
        self.placement = placement
        self.dir = net.root / label
        self.dir.mkdir()
        self.one_host = len({id(host) for host in placement.values()}) == 1
        addresses = {role: host.address for role, host in placement.items()}
        if self.one_host:
            addresses = dict.fromkeys(placement, "127.0.0.1")
        broker = "127.0.0.1" if client is net.hosts["broker"] else net.hosts["broker"].address
        dirs = {role: host.dir for role, host in placement.items()}
        data = federation(f"mh-{label}", broker, addresses, dirs, failover)
        self.config = write_federation(self.dir / "federation.yaml", data)
        self.gms = ",".join(f"{g['host']}:{g['port']}" for g in data["gms"])
        self.procs: list[tuple[Host, object]] = []

    def start(self) -> None:
        conf = ["--config", str(self.config)]
        order = [("lm", "lm-1"), ("lm", "lm-2"), ("gm", "gm-1"), ("gm", "gm-2")]
        for kind, role in order:
            host = self.placement[role]
            proc = host.popen(
                megha(kind, "--id", role, *conf), role_env(host), f"{self.label}-{role}"
            )
            self.procs.append((host, proc))
        for i in (1, 2):
            host = self.placement[f"w-lm-{i}"]
            env = role_env(host, MEGHA_WORKER_OUTPUT_DIR=str(host.dir / f"{self.label}-output"))
            if i == 2 and not self.one_host:
                env["MEGHA_ADVERTISE_HOST"] = host.address
            argv = megha("worker", "--lm", f"lm-{i}", *conf)
            self.procs.append((host, host.popen(argv, env, f"{self.label}-w-lm-{i}")))
        done = self.client.run(probe("ready", str(self.config)), role_env(self.client), 120)
        assert done.returncode == 0, f"{self.label}: the federation never got ready:\n{done.stderr}"

    def stop(self) -> None:
        for host, proc in self.procs:
            host.stop([proc])
        self.procs.clear()

    def replay(
        self, name: str, trace: Path, gms: str = "", during=None
    ) -> tuple[dict, list[dict], object]:
        """Replay ``trace`` from the client through ``gms`` (default: every GM), jobs
        alternating between q1 and q2, with the event recorder on; ``during`` (if any) runs
        meanwhile. The summary, the acknowledged tasks' rows, the recorder's verdict."""
        env = role_env(self.client)
        events = self.dir / f"{name}.events"
        recorder = self.client.popen(probe("record", str(self.config), str(events)), env, name)
        deadline = time.monotonic() + 30
        while not Path(f"{events}.ready").exists():
            assert recorder.poll() is None and time.monotonic() < deadline, "recorder died"
            time.sleep(0.1)
        out = self.dir / name
        argv = replay(str(trace), "--gm", gms or self.gms, "--queue", "q1", "--queue", "q2")
        argv += ["--out", str(out), "--quiet", "--timeout", str(REPLAY_TIMEOUT_S)]
        run = self.client.popen(argv, env, f"{name}-replay")
        try:
            if during is not None:
                during()
            run.wait(REPLAY_TIMEOUT_S + 30)
            time.sleep(1.0)  # the last event batches reach the recorder
        finally:
            self.client.stop([run, recorder])
        summary = json.loads((out / "summary.json").read_text())
        with (out / "tasks.csv").open() as rows:
            acknowledged = list(csv.DictReader(rows))
        verdict = check(read_events(events), [row["task_id"] for row in acknowledged])
        return summary, acknowledged, verdict


def read_events(path: Path) -> list[common_pb2.TaskEvent]:
    data, events, at = path.read_bytes(), [], 0
    while at + 4 <= len(data):
        (size,) = struct.unpack_from(">I", data, at)
        events.extend(common_pb2.TaskEventBatch.FromString(data[at + 4 : at + 4 + size]).events)
        at += 4 + size
    return events


ROLES = ["gm-1", "gm-2", "lm-1", "lm-2", "w-lm-1", "w-lm-2"]


def test_a_replay_across_hosts_completes_once_each_within_twice_the_loopback_p50(net, tmp_path):
    trace = write_trace(tmp_path / "small.tr")
    broker = net.hosts["broker"]
    loopback = Run(net, "loopback", dict.fromkeys(ROLES, broker), broker)
    loopback.start()
    try:
        local, local_rows, local_verdict = loopback.replay("loopback-replay", trace)
    finally:
        loopback.stop()
    hosts = Run(net, "hosts", {r: net.hosts[r] for r in ROLES}, net.hosts["client"])
    hosts.start()
    try:
        nodes = net.hosts["client"].run(
            megha("nodes", "--json", "--config", str(hosts.config)),
            role_env(net.hosts["client"]),
            30,
        )
        spread, spread_rows, spread_verdict = hosts.replay("hosts-replay", trace)
    finally:
        hosts.stop()

    p50_local, p50_hosts = local["alloc_s"]["p50"], spread["alloc_s"]["p50"]
    print(
        f"\nallocation time p50: loopback {p50_local * 1e3:.1f} ms, across hosts "
        f"{p50_hosts * 1e3:.1f} ms ({p50_hosts / p50_local:.2f}x); p99 "
        f"{local['alloc_s']['p99'] * 1e3:.1f} / {spread['alloc_s']['p99'] * 1e3:.1f} ms"
    )
    for summary, rows, verdict in (
        (local, local_rows, local_verdict),
        (spread, spread_rows, spread_verdict),
    ):
        assert summary["completed"] == summary["tasks"] == len(rows) == JOBS
        assert summary["duplicates"] == 0 and summary["failed"] == 0
        assert verdict.ok, verdict.summary()
        assert verdict.attempts_started == JOBS
    assert p50_hosts <= 2 * p50_local
    # Each node advertises its own host's address (lm-1's from the file, lm-2's from
    # MEGHA_ADVERTISE_HOST), with the host's metrics port.
    assert nodes.returncode == 0, nodes.stderr
    advertised = {row["lm_id"]: row["address"] for row in json.loads(nodes.stdout)}
    assert advertised == {
        "lm-1": f"{net.hosts['w-lm-1'].address}:{WORKER_METRICS}",
        "lm-2": f"{net.hosts['w-lm-2'].address}:{WORKER_METRICS}",
    }


def queue_of(row: dict) -> str:
    """The replay's job ``replay-<run>-<index>`` went to q1 (even index) or q2 (odd)."""
    return ("q1", "q2")[int(row["job_id"].rsplit("-", 1)[1]) % 2]


def test_a_gm_cut_off_mid_replay_its_queue_moves_nothing_lost_or_twice(net, tmp_path):
    """gm-2's link goes down for CUT_FOR_S seconds mid-replay while the client submits
    through gm-1 to both queues. With queue failover the broker, once gm-2's heartbeats
    stop, hands q2 to gm-1, which serves it: q2's jobs wait about that long, not the cut.
    Once the link is back, every acknowledged task has ended, none started or succeeded
    twice."""
    trace = write_trace(tmp_path / "small.tr")
    gm2 = net.hosts["gm-2"]
    run = Run(net, "cut", {r: net.hosts[r] for r in ROLES}, net.hosts["client"], failover=True)
    run.start()
    cut: dict[str, float] = {}

    def cut_gm2() -> None:
        time.sleep(CUT_AT_S)
        cut["down"] = time.time()
        gm2.link(up=False)
        try:
            time.sleep(CUT_FOR_S)
        finally:
            gm2.link(up=True)
            cut["up"] = time.time()

    gm1 = run.gms.split(",")[0]
    try:
        summary, acknowledged, verdict = run.replay("cut-replay", trace, gm1, during=cut_gm2)
    finally:
        gm2.link(up=True)
        run.stop()
    waited = {
        queue: max(float(r["alloc_s"]) for r in acknowledged if queue_of(r) == queue)
        for queue in ("q1", "q2")
    }
    print(
        f"\ngm-2 cut off for {cut['up'] - cut['down']:.1f} s (AMQP heartbeat "
        f"{BROKER_HEARTBEAT_S} s): {summary['accepted']} of {summary['tasks']} tasks "
        f"acknowledged, {summary['completed']} completed; longest allocation time q1 "
        f"(gm-1) {waited['q1']:.2f} s, q2 (gm-2's, failed over to gm-1) {waited['q2']:.2f} s; "
        f"{summary['preemptions']} preempted; recorder: {verdict.summary()}"
    )
    assert len(acknowledged) == summary["accepted"] == JOBS  # gm-1 took every job
    assert summary["completed"] == summary["accepted"]  # 0 lost
    assert summary["duplicates"] == 0
    assert verdict.count("started twice") == verdict.count("succeeded twice") == 0
    assert verdict.count("stuck") == 0
    # Served by gm-1 while gm-2 was cut off: no q2 job waited for the link to come back.
    assert waited["q2"] < CUT_FOR_S - 1, waited
