"""A real ``LocalMaster`` of one worker slot over an in-memory bus that is not connected
yet (the broker is away: re-queues keep trying), for tests of what the LM does while
its broker calls wait."""

from __future__ import annotations

from services.common.bus import Bus, InMemoryBroker, make_bus
from services.common.config import parse_config
from services.local_master.service import LocalMaster


def lm_without_broker() -> tuple[LocalMaster, Bus]:
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}],
            "lms": [{"id": "lm-1", "port": 2}],
            "workers": [{"lm": "lm-1", "count": 1, "capacity": "cpu=4,mem=8Gi"}],
        },
        env={},
    )
    bus = make_bus("memory://", broker=InMemoryBroker())
    return LocalMaster(config, "lm-1", bus), bus
