"""Hosts on one machine: each a Linux network namespace with its own address on a bridge.

    bridge mhn-br (no address: the root namespace is not on the subnet, nothing is routed)
      ├─ veth mhn-<host> ══ eth0 10.77.0.<n>/24 in netns mhn-<host> (and its own lo)
      └─ ...

Each namespace has its own loopback, so 127.0.0.1 inside one reaches nothing of another:
a process that dials 127.0.0.1 for a peer fails here as it would across machines. Every
name starts with ``mhn-`` so that a crashed run's leftovers are found and removed by name
(``remove_leftovers``), and nothing else on the machine is touched but one iptables rule
that lets the bridge's own frames through (``_FORWARD``). Needs root and
``ip netns``; ``why_unavailable`` says why not, for a skip.

``Host.popen`` starts a process inside its namespace (``ip netns exec``) with exactly the
environment given, in its own session, so that it is stopped by its process group alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "mhn-"
BRIDGE = f"{PREFIX}br"
# A private /24 that is unlikely to clash with a real network of the machine.
SUBNET = os.environ.get("MEGHA_NETNS_SUBNET", "10.77.0")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def why_unavailable() -> str:
    """Why namespaced hosts cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"{PREFIX}probe"
    try:
        _ip("netns", "del", probe, check=False)
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add fails: {made.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return ""


def remove_leftovers() -> None:
    """What a crashed run of this module left: processes in ``mhn-*`` namespaces (only
    ever started there by it), the namespaces, the bridge and any ``mhn-*`` link."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line]
    for name in names:
        if name.startswith(PREFIX):
            _kill_all_in(name)
            _ip("netns", "del", name, check=False)
    links = _ip("-o", "link", "show").stdout.splitlines()
    for line in links:
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(PREFIX):
            _ip("link", "del", link, check=False)
    while _iptables("-D"):
        pass


# With br_netfilter loaded (Docker loads it, and sets the FORWARD policy to DROP), frames
# bridged between two namespaces go through iptables' FORWARD chain: this rule lets those
# of our bridge through, and only those. Added with the bridge, deleted with it.
_FORWARD = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]


def _iptables(action: str) -> bool:
    if shutil.which("iptables") is None:
        return False
    done = subprocess.run(
        ["iptables", "-w", "10", action, *_FORWARD], capture_output=True, text=True, timeout=30
    )
    return done.returncode == 0


def _kill_all_in(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` (epmd and other daemons that left their
    parent's process group included), by pid."""
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass
class Host:
    """One namespace: ``name`` (netns ``mhn-<name>``), its address and its own directory
    (a machine's disk: nothing in it is read by another host)."""

    name: str
    address: str
    dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def veth(self) -> str:
        """The bridge's end of the host's link (in the root namespace): down cuts it off."""
        return f"{PREFIX}{self.name}"

    def popen(self, argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        out = open(self.dir / f"{log}.log", "ab")  # noqa: SIM115 (lives with the child)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            start_new_session=True,
        )
        out.close()
        self.procs.append(proc)
        return proc

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.dir,
        )

    def link(self, up: bool) -> None:
        _ip("link", "set", self.veth, "up" if up else "down")

    def stop(self, procs: list[subprocess.Popen] | None = None, timeout: float = 15.0) -> None:
        """SIGTERM each of ``procs`` (default: every process this host started) by its
        process group, SIGKILL after ``timeout``."""
        procs = list(self.procs) if procs is None else procs
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            if proc in self.procs:
                self.procs.remove(proc)


class Network:
    """A bridge and hosts on it; ``close`` stops every process and removes it all."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.hosts: dict[str, Host] = {}
        remove_leftovers()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("link", "set", BRIDGE, "up")
        _iptables("-I")

    def add(self, name: str, last_octet: int) -> Host:
        host = Host(name, f"{SUBNET}.{last_octet}", self.root / name)
        host.dir.mkdir(parents=True, exist_ok=True)
        peer = f"mhp-{name}"[:15]
        _ip("netns", "add", host.netns)
        self.hosts[name] = host
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.netns)
        _ip("link", "set", host.veth, "master", BRIDGE)
        _ip("link", "set", host.veth, "up")
        inside = ["netns", "exec", host.netns, "ip"]
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", peer, "name", "eth0")
        _ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        return host

    def close(self) -> None:
        """Stop every process, then whatever is left in a namespace (daemons such as
        epmd that left their process group), then remove the namespaces and the bridge."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.stop()
        for host in self.hosts.values():
            _kill_all_in(host.netns)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", BRIDGE, check=False)
        _iptables("-D")
        self.hosts.clear()


def wait_listening(host: Host, port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Until something accepts on ``host``'s ``port`` (dialled from inside ``host``: the
    root namespace is not on the subnet); RuntimeError if ``proc`` exits first."""
    probe = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(0.5)\n"
        f"sys.exit(s.connect_ex(('{host.address}', {port})))\n"
    )
    deadline = time.monotonic() + timeout
    while True:
        done = host.run(["python3", "-c", probe], {"PATH": os.environ["PATH"]}, timeout=10)
        if done.returncode == 0:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on {host.address}:{port} in {host.netns}")
        time.sleep(0.3)
