"""Every ``megha`` role tunes its garbage collector once it has started."""

from __future__ import annotations

import contextlib

import pytest

from services.app import runner
from services.common import stalls
from services.common.config import default_config, parse_config


class Settled(Exception):
    """Raised by the stand-in for ``stalls.settle``: the role got that far."""


@contextlib.asynccontextmanager
async def started(*_args, **_kwargs):
    yield None


@pytest.fixture
def settled(monkeypatch) -> list[str]:
    """Roles that start nothing real, and a ``settle`` that notes each call and stops."""
    calls: list[str] = []

    def settle(*_args) -> None:
        calls.append("settle")
        raise Settled

    monkeypatch.setattr(stalls, "settle", settle)
    for name in ("running_gm", "running_lm", "running_predictor", "running_workers"):
        monkeypatch.setattr(runner, name, started)
    monkeypatch.setattr(runner, "running_pool_node", started)
    monkeypatch.setattr(runner, "make_bus", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(runner, "InMemoryBroker", lambda: None)
    monkeypatch.setattr(runner, "wait_all_healthy", _healthy)
    return calls


async def _healthy(_config) -> None:
    return None


def _config():
    return parse_config({**default_config(1, 1), "rabbitmq_url": "memory://"}, env={})


@pytest.mark.parametrize(
    ("role", "ident", "pool"),
    [
        ("gm", "gm-1", None),
        ("lm", "lm-1", None),
        ("worker", None, None),
        ("worker", None, ("pool", 0)),
        ("predictor", None, None),
    ],
)
async def test_each_role_tunes_the_collector_once_started(settled, role, ident, pool) -> None:
    with pytest.raises(Settled):
        await runner.serve_role(_config(), role, ident, None, pool)
    assert settled == ["settle"]


async def test_the_embedded_federation_tunes_the_collector(settled) -> None:
    with pytest.raises(Settled):
        await runner.serve_embedded(_config())
    assert settled == ["settle"]
