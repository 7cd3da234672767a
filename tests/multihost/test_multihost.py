"""Multi-host, for real (issue #30 item 3): every GM, LM, worker host and each RabbitMQ node
in its own network namespace with its own address, nothing shared but the federation file.

    client 10.77.0.100 ── megha-loadgen replay, event recorder
    broker 10.77.0.2   ── RabbitMQ (rabbit@localhost, private to the namespace): the
                          loopback baseline's broker only
    b1 .3  b2 .4  b3 .5 ── a 3-node RabbitMQ cluster (rabbit@10.77.0.3 ..., b2 and b3
                          joined to b1); every process's rabbitmq_url lists b1, b2, b3
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
A third replay kills b1 (kill -9: the node every process connected to first, which holds
the user queues' quorum leaders) mid-replay: the processes reconnect to b2, the queues
elect new leaders, the replay completes; every acknowledged task ends, none starts or
succeeds twice, and the client's submissions are accepted again within
``RECOVERY_TARGET_S`` of the kill.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import itertools
import json
import os
import secrets
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadgen.invariants import check
from services._proto.megha.v1 import common_pb2
from services.core.states import TERMINAL
from tests.multihost.netns import Host, Network, why_unavailable
from tests.multihost.roles import (
    AMQP_PORT,
    RABBITMQ_SERVER,
    megha,
    node_name,
    probe,
    rabbitmqctl,
    replay,
    role_env,
    start_rabbitmq,
    start_rabbitmq_cluster,
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
BROKER_NODES = 3
KILL_AT_S = 8.0  # after the replay starts (its first second or two is start-up)
RECOVERY_TARGET_S = 5.0


@pytest.fixture(scope="module")
def net(request):
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
    failed_before = request.session.testsfailed
    try:
        network.add("broker", 2)
        for i in range(1, BROKER_NODES + 1):
            network.add(f"b{i}", 2 + i)
        network.add("client", 100)
        for i in (1, 2):
            network.add(f"gm-{i}", 10 + i)
            network.add(f"lm-{i}", 20 + i)
            network.add(f"w-lm-{i}", 30 + i)
        started = time.monotonic()
        start_rabbitmq(network.hosts["broker"])
        brokers = [network.hosts[f"b{i}"] for i in range(1, BROKER_NODES + 1)]
        cookie = secrets.token_hex(16).upper()
        network.cluster = Cluster(brokers, start_rabbitmq_cluster(brokers, cookie), cookie)
        print(f"\nbrokers started in {time.monotonic() - started:.1f} s")
        yield network
    finally:
        network.close()
        # A failure keeps them too: a rare one (a run of CI) is read from its logs.
        failed = request.session.testsfailed > failed_before
        if os.environ.get("MEGHA_NETNS_KEEP") == "1" or failed:
            print(f"\nhosts' directories and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


@dataclass
class Cluster:
    """The 3-node cluster: its hosts (b1 first), its nodes' processes, its Erlang cookie."""

    hosts: list[Host]
    procs: list[subprocess.Popen]
    cookie: str

    def leaders(self, prefix: str, nodes: list[int]) -> dict[str, tuple[str, str]]:
        """Work queue name -> (type, leader node) of the queues of ``prefix`` led by one of
        ``nodes`` (indices), each asked for its own (``--local``): a ``list_queues`` of the
        whole cluster has the other nodes send their rows to the CLI's own node, named
        after the machine's host name, which no other namespace reaches."""
        found = {}
        for i in nodes:
            out = rabbitmqctl(
                self.hosts[i],
                self.cookie,
                *("-q", "-t", "30", "list_queues", "--local", "name", "type", "leader"),
            )
            for line in out.splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0].startswith(f"{prefix}.queue."):
                    found[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
        return found

    def kill(self, i: int) -> None:
        """kill -9 node ``i`` (0-based): its whole process group (the start script, the
        Erlang VM and its port programs)."""
        os.killpg(self.procs[i].pid, signal.SIGKILL)


def write_trace(path: Path) -> Path:
    """``.tr``: arrival, task count, mean duration, durations."""
    path.write_text("".join(f"{j * SPACING_S:.3f} 1 {TASK_S} {TASK_S}\n" for j in range(JOBS)))
    return path


def broker_urls(brokers: list[str], failover: bool) -> str:
    """``rabbitmq_url``: every node, in the order a process tries them."""
    query = f"?heartbeat={BROKER_HEARTBEAT_S}" if failover else ""
    return ",".join(f"amqp://guest:guest@{b}:{AMQP_PORT}/{query}" for b in brokers)


def federation(
    prefix: str,
    brokers: list[str],
    hosts: dict[str, str],
    dirs: dict[str, Path],
    failover: bool,
) -> dict:
    """The federation file: ``brokers`` the broker nodes' addresses, ``hosts`` each
    role's address (all 127.0.0.1 for the loopback baseline, whose ports then differ),
    ``dirs`` each LM's own directory; ``failover``: queue failover, and AMQP heartbeats
    short enough to notice a cut."""
    one_host = len(set(hosts.values())) == 1
    step = 1 if one_host else 0
    return {
        "rabbitmq_url": broker_urls(brokers, failover),
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
        if client is net.hosts["broker"]:  # the loopback baseline: its own one node
            brokers = ["127.0.0.1"]
        else:
            brokers = [host.address for host in net.cluster.hosts]
        dirs = {role: host.dir for role, host in placement.items()}
        self.prefix = f"mh-{label}"
        data = federation(self.prefix, brokers, addresses, dirs, failover)
        self.config = write_federation(self.dir / "federation.yaml", data)
        # The recorder tries the nodes the other way round: it listens on the last node
        # (never killed), so it misses nothing the surviving nodes carry.
        data["rabbitmq_url"] = broker_urls(brokers[::-1], failover)
        self.recorder_config = write_federation(self.dir / "recorder.yaml", data)
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

    def diagnose(self, alive: list[int]) -> str:
        """What to read when acknowledged work did not finish, taken before ``stop``:
        each GM's view (``megha status``: LMs heard from, tasks pending per queue), the
        user queues' depths and consumers on the live cluster nodes ``alive``, and every
        GM's and LM's asyncio tasks (SIGUSR1: written to its log, kept with the hosts)."""
        out = []
        for _host, proc in self.procs[:4]:  # lm-1, lm-2, gm-1, gm-2 (``start``'s order)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
        env = role_env(self.client)
        for gm in self.gms.split(","):
            argv = megha("status", "--config", str(self.config), "--gm", gm)
            done = self.client.run(argv, env, 30)
            out.append(f"megha status --gm {gm}:\n{done.stdout}{done.stderr}")
        cluster = self.net.cluster
        for i in alive:
            with contextlib.suppress(Exception):
                rows = rabbitmqctl(
                    cluster.hosts[i],
                    cluster.cookie,
                    "list_queues",
                    "--local",
                    "name",
                    "messages_ready",
                    "messages_unacknowledged",
                    "consumers",
                )
                out.append(f"queues led by {node_name(cluster.hosts[i])}:\n{rows}")
        time.sleep(1.0)  # the task dumps reach the logs
        return "\n".join(out)

    def replay(
        self, name: str, trace: Path, gms: str = "", during=None, fill_ends: bool = False
    ) -> tuple[dict, list[dict], object]:
        """Replay ``trace`` from the client through ``gms`` (default: every GM), jobs
        alternating between q1 and q2, with the event recorder on; ``during`` (if any) runs
        meanwhile. The summary, the acknowledged tasks' rows, the recorder's verdict
        (``fill_ends``: with the ends the client saw of the tasks whose end the recorder
        did not hear, ``ends_not_recorded``)."""
        env = role_env(self.client)
        events = self.dir / f"{name}.events"
        recorder = self.client.popen(
            probe("record", str(self.recorder_config), str(events)), env, name
        )
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
        recorded = read_events(events)
        self.filled = ends_not_recorded(recorded, acknowledged) if fill_ends else []
        recorded += self.filled
        self.recorded = recorded
        verdict = check(recorded, [row["task_id"] for row in acknowledged])
        return summary, acknowledged, verdict


def ends_not_recorded(
    recorded: list[common_pb2.TaskEvent], acknowledged: list[dict]
) -> list[common_pb2.TaskEvent]:
    """The end, as the client saw it (its GM's WatchJob), of each acknowledged task whose
    end the recorder never heard: an event a process published on its connection to a
    node in the moment that node was killed may be gone with it, though the GM's book has
    it. Only ends: what started (twice or not) is still the recorder's alone."""
    ended = {e.task_id for e in recorded if e.state in TERMINAL}
    filled = []
    for row in acknowledged:
        state = common_pb2.TaskState.Value(f"TASK_STATE_{row['state'].upper()}")
        if row["task_id"] not in ended and state in TERMINAL:
            filled.append(
                common_pb2.TaskEvent(
                    task_id=row["task_id"],
                    state=state,
                    attempt=int(row["attempt"] or 0),
                    node_id=row["node_id"],
                )
            )
    return filled


def longest_gap(acknowledged: list[dict], queue: str, at: float, end: float) -> tuple[float, float]:
    """How long ``queue`` went without an accepted submission from ``at`` on, and when
    that stretch began (relative to ``at``). The client submits one job after another,
    each once the previous one was answered, so the time between the submit stamps of two
    accepted jobs bounds the time between their acceptances; a queue whose submissions
    stopped being accepted counts until ``end``, when the client's last job was due."""
    sent = sorted(
        int(r["submitted_unix_nanos"]) / 1e9 for r in acknowledged if queue_of(r) == queue
    )
    sent.append(max(end, sent[-1] if sent else end))
    gaps = [(b - a, a - at) for a, b in itertools.pairwise(sent) if b > at]
    return max(gaps) if gaps else (float("inf"), 0.0)


def attempts_started(events: list[common_pb2.TaskEvent]) -> dict[str, set[int]]:
    """Task id -> the attempts the recorder saw start."""
    started: dict[str, set[int]] = {}
    for e in events:
        if e.timestamps.started_unix_nanos:
            started.setdefault(e.task_id, set()).add(e.attempt)
    return started


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


def test_a_broker_node_killed_mid_replay_loses_nothing_and_runs_nothing_twice(net, tmp_path):
    """kill -9 of b1, the node every process connected to first and which holds the user
    queues' quorum leaders, mid-replay (through both GMs). The processes reconnect to b2,
    b2 and b3 elect new leaders; the replay completes, every acknowledged task ends, none
    starts or succeeds twice, and submissions are accepted again within
    RECOVERY_TARGET_S: the client submits one job after another (each waits for the
    previous one's answer), so the longest gap between the submit stamps of accepted jobs
    from the kill on is how long it went without an acceptance."""
    trace = write_trace(tmp_path / "small.tr")
    cluster = net.cluster
    run = Run(net, "kill", {r: net.hosts[r] for r in ROLES}, net.hosts["client"])
    run.start()
    victim = node_name(cluster.hosts[0])
    try:
        before = cluster.leaders(run.prefix, [0, 1, 2])
        user_queues = {q: v for q, v in before.items() if ".queue.user." in q}
        assert len(user_queues) == 2, before
        assert all(v == ("quorum", victim) for v in user_queues.values()), before
        killed: dict[str, float] = {}

        def kill_b1() -> None:
            time.sleep(KILL_AT_S)
            killed["at"] = time.time()
            cluster.kill(0)

        summary, acknowledged, verdict = run.replay(
            "kill-replay", trace, during=kill_b1, fill_ends=True
        )
        after = cluster.leaders(run.prefix, [1, 2])
        if summary["completed"] != len(acknowledged):
            print(run.diagnose(alive=[1, 2]))
    finally:
        run.stop()
    at = killed["at"]
    # The last job was due (JOBS - 1) * SPACING_S after the replay began.
    end = summary["started_unix_nanos"] / 1e9 + (JOBS - 1) * SPACING_S
    gaps = {q: longest_gap(acknowledged, q, at, end) for q in ("q1", "q2")}
    worst = max(gap for gap, _ in gaps.values())
    started = attempts_started(run.recorded)
    acked = {row["task_id"] for row in acknowledged}
    unacked_ran = sorted(t for t in started if t not in acked)
    retried = sorted(t for t in acked if len(started.get(t, ())) > 1)
    started_at = summary["started_unix_nanos"] / 1e9
    print(
        f"\nkill -9 {victim} (leader of {len(user_queues)} user queues) "
        f"{at - started_at:.1f} s into the replay: {summary['accepted']} of "
        f"{summary['tasks']} tasks acknowledged (submit errors {summary['submit_errors']}, "
        f"rerouted {summary['rerouted_submissions']}), {summary['completed']} completed, "
        f"{summary['failed']} failed, {summary['duplicates']} duplicates; per queue, the "
        f"longest time without an accepted submission from the kill on: "
        + ", ".join(f"{q} {g:.2f} s (from {f:+.2f} s of the kill)" for q, (g, f) in gaps.items())
        + f"; allocation time p50 {summary['alloc_s']['p50'] * 1e3:.1f} ms, max "
        f"{max(float(r['alloc_s'] or 0) for r in acknowledged):.2f} s; recorder: "
        f"{verdict.summary()} ({len(run.filled)} ends only the client saw; "
        f"{len(retried)} acknowledged tasks ran a second attempt, {len(unacked_ran)} tasks "
        f"of refused jobs started: {unacked_ran[:4]}); leaders now "
        f"{ {q.rsplit('.', 1)[-1]: v[1] for q, v in after.items() if '.user.' in q} }"
    )
    unfinished = collections.Counter(
        (queue_of(r), r["gm"], r["state"]) for r in acknowledged if r["state"] != "succeeded"
    )
    if unfinished:
        print(f"not completed (queue, GM, state as the client saw it): {dict(unfinished)}")
    assert summary["completed"] == summary["accepted"] == len(acknowledged)  # 0 lost
    assert summary["duplicates"] == 0 and summary["failed"] == 0
    assert verdict.ok, "\n".join(str(v) for v in verdict.violations[:20])
    # Each user queue has a leader again, on b2 or b3.
    assert {q: t for q, (t, _) in after.items() if q in user_queues} == dict.fromkeys(
        user_queues, "quorum"
    ), after
    assert worst <= RECOVERY_TARGET_S, gaps
