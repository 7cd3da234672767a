"""What the machine a worker host runs on really has: CPUs and memory, so that nodes
running real tasks (process and docker executors) do not advertise more than it.

    sched_getaffinity (CPUs this process may run on) ─┐
    cgroup v2 cpu.max (a container's CPU quota)  ─────┼─▶ min ─▶ Machine(cpu_milli, memory_mb)
    physical memory (sysconf), cgroup memory.max ─────┘
    Machine + configured capacity ──cap──▶ what each node advertises (+ what was cut)

Best effort: a source that cannot be read (no cgroup v2, another OS) is left out; CPUs
fall back to ``os.cpu_count``. Each node of a host is capped to the whole machine, not a
share of it: a group of many nodes on one machine is a deliberate simulation, sized by its
config; what the cap stops is one node claiming more than any machine it runs on has.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.core.resources import CPU, MEMORY, RESOURCE_NAMES

_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Machine:
    cpu_milli: int
    memory_mb: int


def _own_cgroup() -> Path | None:
    """This process's cgroup v2 directory, or None (cgroup v1, or not Linux)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return _CGROUP / line[3:].lstrip("/")
    except OSError:
        return None
    return None


def _cgroup_limit(cgroup: Path | None, name: str, parse: Callable[[str], int | None]) -> int | None:
    """The smallest limit in file ``name`` of this cgroup and its parents (``parse``: the
    file's text as a limit, None for none), if any."""
    best = None
    while cgroup is not None and cgroup.is_relative_to(_CGROUP):
        try:
            limit = parse((cgroup / name).read_text())
            if limit is not None:
                best = limit if best is None else min(best, limit)
        except (OSError, ValueError):
            pass
        if cgroup == _CGROUP:
            break
        cgroup = cgroup.parent
    return best


def _cpu_max_milli(text: str) -> int | None:
    quota, period = text.split()[:2]
    return None if quota == "max" else math.ceil(int(quota) * 1000 / int(period))


def _memory_max_mb(text: str) -> int | None:
    text = text.strip()
    return None if text == "max" else int(text) >> 20


def _cgroup_cpu_milli(cgroup: Path | None) -> int | None:
    """The CPU quota (cpu.max "quota period") of this cgroup and its parents, if any."""
    return _cgroup_limit(cgroup, "cpu.max", _cpu_max_milli)


def _cgroup_memory_mb(cgroup: Path | None) -> int | None:
    """The memory limit (memory.max) of this cgroup and its parents, if any."""
    return _cgroup_limit(cgroup, "memory.max", _memory_max_mb)


def machine() -> Machine:
    """The CPUs (millicores) and memory (MiB) this process can use on this machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    cpu_milli = cpus * 1000
    try:
        memory_mb = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 20
    except (AttributeError, ValueError, OSError):
        memory_mb = 0  # unknown: not capped
    cgroup = _own_cgroup()
    quota = _cgroup_cpu_milli(cgroup)
    if quota is not None:
        cpu_milli = min(cpu_milli, max(quota, 1))
    limit = _cgroup_memory_mb(cgroup)
    if limit is not None and limit > 0:
        memory_mb = min(memory_mb, limit) if memory_mb else limit
    return Machine(cpu_milli, memory_mb)


def cap_to_machine(capacity: np.ndarray, host: Machine) -> tuple[np.ndarray, list[str]]:
    """``capacity`` with its CPU and memory cut down to ``host``'s, and what was cut (as
    ``"cpu_milli 4000 -> 2000"``); disk and network are left as configured."""
    capped = np.array(capacity, dtype=np.int64).copy()
    cut = []
    for index, real in ((CPU, host.cpu_milli), (MEMORY, host.memory_mb)):
        if 0 < real < capped[index]:
            cut.append(f"{RESOURCE_NAMES[index]} {int(capped[index])} -> {real}")
            capped[index] = real
    return capped, cut
