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
def tls_rabbitmq(directory: Path, files: dict[str, str], plain_port: int = 0) -> Iterator[int]:
    """Run the node with the CA, certificate and key of ``files`` (``make_tls_files``);
    yields its AMQPS port on 127.0.0.1. With ``plain_port``, it also listens for plain
    AMQP there (to compare the two on one node)."""
    if not SERVER.exists():
        pytest.skip(f"{SERVER} is not installed (apt-get install rabbitmq-server)")
    directory.mkdir(parents=True, exist_ok=True)
    port, dist_port = free_ports(2)
    plain = "listeners.tcp = none"
    if plain_port:
        plain = f"listeners.tcp.default = 127.0.0.1:{plain_port}"
    (directory / "rabbitmq.conf").write_text(
        f"{plain}\n"
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


def main() -> None:
    """Run such a node until Ctrl-C, with certificates in ``--dir``, and print how to
    point a federation (or ``megha-loadgen bench-live``) at it."""
    import argparse

    from tests.tls_files import make_tls_files

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/megha-tls-broker"))
    parser.add_argument("--plain-port", type=int, default=0, help="also plain AMQP here")
    args = parser.parse_args()
    files = make_tls_files(args.dir / "tls")
    with tls_rabbitmq(args.dir / "node", files, args.plain_port) as port:
        tls = ", ".join(f"{name}: {path}" for name, path in files.items())
        print(f"export MEGHA_TLS='{{{tls}}}'")
        print(f"export MEGHA_RABBITMQ_URL=amqps://guest:guest@127.0.0.1:{port}/")
        if args.plain_port:
            print(f"# plain AMQP on the same node: amqp://guest:guest@127.0.0.1:{args.plain_port}/")
        print("# Ctrl-C stops the node", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                signal.pause()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
