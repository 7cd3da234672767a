"""The order an LM writes a worker's commands in: kills go ahead of the starts that wait
for the worker's stream. A start that waited for a new stream (the old one broke) used to
overtake the kill of a stale attempt the worker's registration found still running, and
the node held both at once (``chaos-sim --small --seed 7277``)."""

from __future__ import annotations

from services._proto.megha.v1 import common_pb2
from services.common.bus import make_bus
from services.common.config import parse_config
from services.local_master.service import LocalMaster, WorkerSession


def lm() -> LocalMaster:
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}],
            "lms": [{"id": "lm-1", "port": 2}],
            "workers": [{"lm": "lm-1", "count": 1, "capacity": "cpu=4,mem=8Gi"}],
        },
        env={},
    )
    master = LocalMaster(config, "lm-1", make_bus("memory://"))
    master.sessions[0] = WorkerSession(0, "lm-1-w0")
    return master


def what(session: WorkerSession) -> list[str]:
    out = []
    for command in session.commands:
        if command.HasField("start"):
            out.append(f"start {command.start.task.task_id}")
        else:
            out.append(f"kill {command.kill.task_id}")
    return out


def test_kills_go_ahead_of_unwritten_starts_in_their_own_order():
    master = lm()
    session = master.sessions[0]
    master._send(0, start=common_pb2.Task(task_id="a.0"))
    master._send(0, start=common_pb2.Task(task_id="b.0"))
    session.written.add(id(session.commands[0]))  # a.0's write began: it stays first
    master._send(0, kill=("old.0", 0, "stale"))
    master._send(0, kill=("old.1", 0, "stale"))
    master._send(0, start=common_pb2.Task(task_id="c.0"))
    assert what(session) == ["start a.0", "kill old.0", "kill old.1", "start b.0", "start c.0"]
