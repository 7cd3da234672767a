"""A private RabbitMQ node that speaks only AMQP over TLS (mutual: it requires a client
certificate signed by the test CA), for the tests of the broker connection over TLS.

It runs the installed server (Debian's ``rabbitmq-server`` package) as a second node
under its own name, ports, cookie and data directory, so the shared broker on 5672 is
left alone. It starts in about 6 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import free_ports

SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def tls_rabbitmq(directory: Path, files: dict[str, str]) -> Iterator[int]:
    """Run the node with the CA, certificate and key of ``files`` (``make_tls_files``);
    yields its AMQPS port on 127.0.0.1."""
    if not SERVER.exists():
        pytest.skip(f"{SERVER} is not installed (apt-get install rabbitmq-server)")
    directory.mkdir(parents=True, exist_ok=True)
    port, dist_port = free_ports(2)
    (directory / "rabbitmq.conf").write_text(
        "listeners.tcp = none\n"
        f"listeners.ssl.default = 127.0.0.1:{port}\n"
        f"ssl_options.cacertfile = {files['ca']}\n"
        f"ssl_options.certfile = {files['cert']}\n"
        f"ssl_options.keyfile = {files['key']}\n"
        "ssl_options.verify = verify_peer\n"
        "ssl_options.fail_if_no_peer_cert = true\n"
    )
    (directory / "enabled_plugins").write_text("[].\n")
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/bin"),
        "HOME": str(directory),  # its own Erlang cookie
        "RABBITMQ_NODENAME": f"megha-tls-{uuid.uuid4().hex[:8]}@localhost",
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq"),
        "RABBITMQ_CONF_ENV_FILE": "/dev/null",  # not the shared node's name and settings
        "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
        "RABBITMQ_LOG_BASE": str(directory / "log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
    }
    log = (directory / "rabbitmq.out").open("wb")
    node = subprocess.Popen(
        [str(SERVER)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _listening(port):
            if node.poll() is not None or time.monotonic() > deadline:
                out = (directory / "rabbitmq.out").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the TLS RabbitMQ node did not start:\n{out}")
            time.sleep(0.2)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        log.close()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0
