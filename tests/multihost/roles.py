"""The federation's roles on namespaced hosts (``tests.multihost.netns``).

    broker host ── RabbitMQ node rabbit@localhost (its own epmd, mnesia, logs), AMQP on
                   every address of the host (guest may connect from other hosts)
    b1, b2, b3 hosts ── a 3-node RabbitMQ cluster, one node per host, each named by its
                   address (rabbit@10.77.0.3: long names, nothing to resolve), b2 and b3
                   joined to b1
    gm-i, lm-i, w-lm-i hosts ── ``megha gm|lm|worker`` with the federation file, nothing else
    client host ── the load generator and the event recorder

Every process gets exactly the environment ``role_env`` builds (no ``MEGHA_*`` of the test
run leaks in): this interpreter, this checkout, and a ``TMPDIR`` in its host's own
directory, so ledgers and task output are the host's own, as on separate machines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.multihost.netns import Host, wait_listening

REPO = Path(__file__).resolve().parents[2]
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
RABBITMQCTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")
AMQP_PORT = 5672
BROKER_START_S = 90.0
CTL_TIMEOUT_S = 120.0


def role_env(host: Host, **extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/bin"),
        "PYTHONPATH": str(REPO),
        "HOME": str(host.dir),
        "TMPDIR": str(host.dir),
        "LANG": "C.UTF-8",
        **extra,
    }


def start_rabbitmq(host: Host) -> None:
    """A RabbitMQ node of its own on ``host``: ``rabbit@localhost`` is private to the
    namespace (its own loopback, its own epmd), so the machine's shared node and any other
    engineer's nodes are never reached. Returns once it accepts AMQP on the host's address."""
    node = host.dir / "rabbitmq"
    node.mkdir(exist_ok=True)
    # loopback_users: guest may log in from other hosts (the default allows loopback only).
    (node / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = {AMQP_PORT}\nloopback_users = none\n"
    )
    (node / "enabled_plugins").write_text("[].\n")
    env = role_env(
        host,
        RABBITMQ_NODENAME="rabbit@localhost",
        RABBITMQ_CONFIG_FILE=str(node / "rabbitmq"),
        RABBITMQ_CONF_ENV_FILE="/dev/null",  # not the shared node's name and settings
        RABBITMQ_MNESIA_BASE=str(node / "mnesia"),
        RABBITMQ_LOG_BASE=str(node / "log"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(node / "enabled_plugins"),
        ERL_EPMD_ADDRESS="127.0.0.1",
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
    )
    proc = host.popen([str(RABBITMQ_SERVER)], env, "rabbitmq")
    try:
        wait_listening(host, AMQP_PORT, proc, BROKER_START_S)
    except RuntimeError as err:
        tail = (host.dir / "rabbitmq.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{err}: the RabbitMQ node did not start:\n{tail}") from None


def node_name(host: Host) -> str:
    """A cluster node's name: its host's address, so that Erlang distribution needs no
    name resolution (``RABBITMQ_USE_LONGNAME``)."""
    return f"rabbit@{host.address}"


def _node_env(host: Host, cookie: str) -> dict[str, str]:
    """The environment of a cluster node and of ``rabbitmqctl`` on its host: long names,
    and the cluster's one Erlang cookie in ``HOME`` (the host's own directory)."""
    path = host.dir / ".erlang.cookie"
    if not path.exists() or path.read_text() != cookie:
        path.unlink(missing_ok=True)
        path.write_text(cookie)
        path.chmod(0o400)
    return role_env(host, RABBITMQ_USE_LONGNAME="true", RABBITMQ_CONF_ENV_FILE="/dev/null")


def rabbitmqctl(host: Host, cookie: str, *args: str, node: str = "") -> str:
    """``rabbitmqctl -n NODE ARGS`` run on ``host`` (default node: the host's own)."""
    argv = [str(RABBITMQCTL), "-l", "-n", node or node_name(host), *args]
    done = host.run(argv, _node_env(host, cookie), timeout=CTL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {host.netns}: {done.stderr}")
    return done.stdout


def start_rabbitmq_cluster(hosts: list[Host], cookie: str) -> list[subprocess.Popen]:
    """A RabbitMQ node on each of ``hosts`` (``rabbit@<address>``, its own epmd in its
    namespace, one shared cookie), the others joined to the first (stop_app,
    join_cluster, start_app on the joining node's host). The nodes' processes, in order
    (each the leader of its own process group: ``os.killpg`` kills the node)."""
    procs = []
    for host in hosts:
        node = host.dir / "rabbitmq"
        node.mkdir(exist_ok=True)
        (node / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {AMQP_PORT}\nloopback_users = none\n"
        )
        (node / "enabled_plugins").write_text("[].\n")
        env = _node_env(host, cookie) | {
            "RABBITMQ_NODENAME": node_name(host),
            "RABBITMQ_CONFIG_FILE": str(node / "rabbitmq"),
            "RABBITMQ_MNESIA_BASE": str(node / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node / "enabled_plugins"),
        }
        procs.append(host.popen([str(RABBITMQ_SERVER)], env, "rabbitmq"))
    for host, proc in zip(hosts, procs, strict=True):
        try:
            wait_listening(host, AMQP_PORT, proc, BROKER_START_S)
            rabbitmqctl(host, cookie, "await_startup", "--timeout", str(int(BROKER_START_S)))
        except RuntimeError as err:
            tail = (host.dir / "rabbitmq.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{err}: node {node_name(host)} did not start:\n{tail}") from None
    first = node_name(hosts[0])
    for host in hosts[1:]:
        rabbitmqctl(host, cookie, "stop_app")
        rabbitmqctl(host, cookie, "join_cluster", first)
        rabbitmqctl(host, cookie, "start_app")
    return procs


def write_federation(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def megha(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def probe(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.multihost.probe", *args]


def replay(*args: str) -> list[str]:
    return [sys.executable, "-m", "loadgen.cli", "replay", *args]
