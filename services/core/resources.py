"""Resource vectors: the four quantities every node offers and every task asks for.

A resource vector is a numpy ``int64`` array of length ``NUM_RESOURCES`` in the order
``cpu_milli, memory_mb, disk_mb, net_mbps``. Plain arrays (not a class) because the hot
path compares a request against a whole column of nodes at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

RESOURCE_NAMES: tuple[str, ...] = ("cpu_milli", "memory_mb", "disk_mb", "net_mbps")
NUM_RESOURCES = len(RESOURCE_NAMES)
CPU, MEMORY, DISK, NET = range(NUM_RESOURCES)

# Human spellings accepted by ``parse_resources`` -> index into the vector.
_ALIASES: dict[str, int] = {
    "cpu": CPU,
    "cpu_milli": CPU,
    "mem": MEMORY,
    "memory": MEMORY,
    "memory_mb": MEMORY,
    "disk": DISK,
    "disk_mb": DISK,
    "net": NET,
    "network": NET,
    "net_mbps": NET,
}

# Upper bound per quantity. It keeps sums of many tasks far from int64 overflow and
# catches unit mistakes ("mem=2000000Gi") with a readable error.
MAX_VALUE = 1 << 40

_QUANTITY = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$")

# Memory/disk units -> MiB. Decimal (G, M) and binary (Gi, Mi) suffixes are both
# accepted; decimal ones are converted exactly, then rounded up to whole MiB.
_BYTES_PER_UNIT: dict[str, float] = {
    "": 1024**2,  # a bare number is already MiB
    "k": 1e3,
    "ki": 1024,
    "m": 1e6,
    "mi": 1024**2,
    "g": 1e9,
    "gi": 1024**3,
    "t": 1e12,
    "ti": 1024**4,
}
# Network units -> Mbit/s.
_MBPS_PER_UNIT: dict[str, float] = {"": 1, "k": 1e-3, "m": 1, "g": 1e3, "t": 1e6}


class ResourceError(ValueError):
    """A resource vector or a human resource string is invalid; the message says why."""


def resources(
    cpu_milli: int = 0, memory_mb: int = 0, disk_mb: int = 0, net_mbps: int = 0
) -> np.ndarray:
    """Build a resource vector from keyword quantities."""
    return np.array([cpu_milli, memory_mb, disk_mb, net_mbps], dtype=np.int64)


def zeros() -> np.ndarray:
    return np.zeros(NUM_RESOURCES, dtype=np.int64)


def _parse_cpu(text: str) -> int:
    match = _QUANTITY.match(text)
    if not match:
        raise ResourceError(f"cannot read cpu quantity {text!r}; use e.g. cpu=2 or cpu=500m")
    num, unit = float(match["num"]), match["unit"].lower()
    if unit == "m":
        return int(np.ceil(num))
    if unit == "":
        return int(np.ceil(num * 1000))
    raise ResourceError(f"unknown cpu unit {match['unit']!r} in {text!r}; use cores or 'm'")


def _parse_scaled(text: str, name: str, table: Mapping[str, float], divisor: float) -> int:
    match = _QUANTITY.match(text)
    if not match:
        raise ResourceError(f"cannot read {name} quantity {text!r}")
    unit = match["unit"].lower().removesuffix("b").removesuffix("bps")
    if unit not in table:
        allowed = ", ".join(repr(u) for u in table if u)
        raise ResourceError(f"unknown {name} unit {match['unit']!r} in {text!r}; use {allowed}")
    return int(np.ceil(float(match["num"]) * table[unit] / divisor))


def parse_resources(text: str) -> np.ndarray:
    """Parse ``"cpu=500m,mem=2Gi,disk=10Gi,net=100M"`` into a resource vector.

    CPU is in cores (``2``, ``0.5``) or millicores (``500m``); memory and disk take byte
    suffixes (``512Mi``, ``2Gi``, ``1G``; a bare number is MiB); network takes bit-rate
    suffixes (``100M``, ``1G``; a bare number is Mbit/s). Quantities round up.
    """
    vector, _ = parse_quantities(text)
    validate_request(vector)
    return vector


def parse_quantities(text: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """``parse_resources`` without the checks of a request: the vector and the indices
    of the quantities the text names (a queue limit leaves the others unlimited)."""
    vector = zeros()
    seen: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise ResourceError(f"expected name=quantity, got {item!r}")
        if key not in _ALIASES:
            known = ", ".join(sorted({"cpu", "mem", "disk", "net"}))
            raise ResourceError(f"unknown resource {key!r}; known: {known}")
        index = _ALIASES[key]
        if index in seen:
            raise ResourceError(f"resource {RESOURCE_NAMES[index]} given twice in {text!r}")
        seen.add(index)
        if index == CPU:
            vector[index] = _parse_cpu(value)
        elif index == NET:
            vector[index] = _parse_scaled(value, "network", _MBPS_PER_UNIT, 1)
        else:
            name = "memory" if index == MEMORY else "disk"
            vector[index] = _parse_scaled(value, name, _BYTES_PER_UNIT, 1024**2)
    if not seen:
        raise ResourceError("no resources given; use e.g. cpu=1,mem=512Mi")
    return vector, tuple(sorted(seen))


_UNIT = ("m", "Mi", "Mi", "M")


def format_quantity(index: int, value: int) -> str:
    """One quantity as ``parse_resources`` reads it: ``cpu`` in cores (``4``) or
    millicores (``1500m``), memory and disk in MiB, network in Mbit/s."""
    if index == CPU:
        return f"{value / 1000:g}" if value % 1000 == 0 else f"{value}m"
    return f"{value}{_UNIT[index]}"


def format_resources(vector: Iterable[int]) -> str:
    """Render a vector the way a person reads it: ``cpu=1.5 mem=2048Mi disk=0Mi net=0M``."""
    cpu, mem, disk, net = (int(v) for v in vector)
    cores = f"{cpu / 1000:g}" if cpu % 1000 == 0 or cpu >= 10_000 else f"{cpu}m"
    return f"cpu={cores} mem={mem}Mi disk={disk}Mi net={net}M"


# Requests found valid, by dtype and bytes: a trace's tasks share a few shapes, and
# checking one costs three numpy calls (a tenth of creating a simulated task).
_VALID_REQUESTS: set[tuple[str, bytes]] = set()
_VALID_REQUESTS_MAX = 4096


def validate_request(vector: np.ndarray) -> None:
    """A task request: no negative quantity, something asked for, nothing absurd."""
    _validate_shape(vector, "request")
    key = (vector.dtype.str, vector.tobytes())
    if key in _VALID_REQUESTS:
        return
    if (vector < 0).any():
        raise ResourceError(f"request has a negative quantity: {_describe(vector < 0, vector)}")
    if not (vector > 0).any():
        raise ResourceError("request asks for nothing; a task needs some cpu or memory")
    _validate_bounds(vector, "request")
    if len(_VALID_REQUESTS) >= _VALID_REQUESTS_MAX:
        _VALID_REQUESTS.clear()
    _VALID_REQUESTS.add(key)


def validate_capacity(vector: np.ndarray) -> None:
    """A node capacity: no negative quantity and at least some CPU and memory."""
    _validate_shape(vector, "capacity")
    if (vector < 0).any():
        raise ResourceError(f"capacity has a negative quantity: {_describe(vector < 0, vector)}")
    if vector[CPU] <= 0 or vector[MEMORY] <= 0:
        raise ResourceError("a node needs cpu_milli > 0 and memory_mb > 0")
    _validate_bounds(vector, "capacity")


# The largest node an LM registers unless its config says otherwise (max_node_capacity):
# above the largest single servers sold today (about 1,000 hardware threads, 16 TiB of
# memory), far below MAX_VALUE, so a forged or mistyped registration (a worker claiming
# 2**40 CPUs) cannot make GMs send a node every task of a federation.
DEFAULT_MAX_NODE_CAPACITY = "cpu=1024,mem=16Ti,disk=1024Ti,net=1T"


def parse_bound(text: str, base: np.ndarray | None = None) -> np.ndarray:
    """A per-node bound from ``"cpu=256,mem=2Ti"``: the quantities named, the rest from
    ``base`` (default ``DEFAULT_MAX_NODE_CAPACITY``). Each named one must be above 0 (a
    bound of 0 would refuse every node) and at most ``MAX_VALUE``."""
    bound = (
        parse_quantities(DEFAULT_MAX_NODE_CAPACITY)[0] if base is None else np.array(base).copy()
    )
    if not text.strip():
        return bound
    vector, named = parse_quantities(text)
    zero = [RESOURCE_NAMES[i] for i in named if vector[i] <= 0]
    if zero:
        raise ResourceError(f"a bound must be above 0: {', '.join(zero)} is 0")
    too_big = [RESOURCE_NAMES[i] for i in named if vector[i] > MAX_VALUE]
    if too_big:
        raise ResourceError(f"bound quantity out of range: {', '.join(too_big)}")
    for i in named:
        bound[i] = vector[i]
    return bound


def above_bound(capacity: np.ndarray, bound: np.ndarray) -> str:
    """Why ``capacity`` exceeds the per-node ``bound`` ("" when it does not): each field
    over it, with its value and the bound, in wire names and as people write them."""
    over = np.flatnonzero(capacity > bound)
    return "; ".join(
        f"{RESOURCE_NAMES[i]}={int(capacity[i])} is above the bound {int(bound[i])} "
        f"({_SHORT[i]}={format_quantity(i, int(bound[i]))})"
        for i in over
    )


_SHORT = ("cpu", "mem", "disk", "net")


def _validate_shape(vector: np.ndarray, what: str) -> None:
    if vector.shape != (NUM_RESOURCES,):
        raise ResourceError(f"{what} must have {NUM_RESOURCES} quantities, got {vector.shape}")


def _validate_bounds(vector: np.ndarray, what: str) -> None:
    too_big = vector > MAX_VALUE
    if too_big.any():
        raise ResourceError(f"{what} quantity out of range: {_describe(too_big, vector)}")


def _describe(mask: np.ndarray, vector: np.ndarray) -> str:
    return ", ".join(f"{RESOURCE_NAMES[i]}={int(vector[i])}" for i in np.flatnonzero(mask))
