"""The broker users' permission regexes (``role_permissions``): who may touch which
exchange, checked name by name as RabbitMQ matches them."""

from __future__ import annotations

import re

from services.app.broker_users import role_permissions


def _may(permissions, what: str, name: str) -> bool:
    return re.search(getattr(permissions, what), name) is not None


def test_only_gms_tell_and_hear_the_backlogs_and_everyone_keeps_the_rest():
    roles = role_permissions("megha")
    for what in ("configure", "write", "read"):
        # claims: oldest: each GM publishes its backlog and hears every GM's.
        assert _may(roles["gm"], what, "megha.backlogs")
        assert not _may(roles["lm"], what, "megha.backlogs")
        assert not _may(roles["reader"], what, "megha.backlogs")
    assert _may(roles["lm"], "write", "megha.heartbeats")
    assert not _may(roles["gm"], "write", "megha.heartbeats")
    assert _may(roles["reader"], "read", "megha.events")
    assert not _may(roles["gm"], "read", "megha.backlogs.x")  # anchored: whole names only
