"""What the memory benchmarks in this folder share: resident memory, the time a full
garbage collection takes, and printing a result.

To measure an older checkout with the same script, put that checkout first on the path:
``PYTHONPATH=path/to/old python scripts/ended_bench.py``.
"""

from __future__ import annotations

import gc
import json
import statistics
import time


def rss_kb() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def full_collection_ms(times: int = 5) -> float:
    """The median time of ``times`` full collections of this process."""
    pauses = []
    for _ in range(times):
        began = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - began)
    return round(1000 * statistics.median(pauses), 1)


def emit(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:22} {value}")
