"""What GMs and LMs remember of ended tasks is bounded by the config: a long-lived
federation's memory levels off (``megha-loadgen bench-live`` draws it, ``memory.png``)."""

from __future__ import annotations

from services._proto.megha.v1 import common_pb2
from services.common.bus import make_bus
from services.common.config import parse_config
from services.global_master.service import GlobalMaster
from services.local_master.service import LocalMaster


def _config(tmp_path, **bounds):
    return parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}],
            "lms": [{"id": "lm-1", "port": 2, "journal": str(tmp_path / "lm-1.journal")}],
            **bounds,
        },
        env={},
    )


def test_the_defaults_are_the_documented_ones(tmp_path):
    config = _config(tmp_path)
    assert (config.gm_job_history_tasks, config.lm_ended_kept, config.lm_endings_kept) == (
        500_000,
        1_000_000,
        100_000,
    )


async def test_an_lm_keeps_the_configured_number_of_endings_in_memory_and_journal(tmp_path):
    config = _config(tmp_path, lm_ended_kept=10_000, lm_endings_kept=1_000)
    lm = LocalMaster(config, "lm-1", make_bus("memory://"))
    for i in range(1_500):
        task = common_pb2.Task(task_id=f"t{i}", job_id="j")
        lm.state.remember_ended(task.task_id, 0)
        lm._event(task, common_pb2.TASK_STATE_SUCCEEDED, -1, "")
    lm._write_pending()
    assert list(lm.endings) == [f"t{i}" for i in range(500, 1_500)]
    recalled = lm.journal.load()
    assert len(recalled.attempts) == 1_500  # under lm_ended_kept: every attempt
    assert [e.task_id for e in recalled.events][-1] == "t1499"
    assert len(recalled.events) >= 1_000  # trimmed to the bound in rounds, never below it
    for i in range(9_000):  # 10,500 in all: past lm_ended_kept, the oldest are forgotten
        lm.state.remember_ended(f"more{i}", 0)
    assert lm.state.known_attempt("t499") is None
    assert lm.state.known_attempt("t500") == (0, False)
    lm.journal.close()


async def test_a_gm_remembers_the_configured_number_of_tasks(tmp_path):
    gm = GlobalMaster(_config(tmp_path, gm_job_history_tasks=5_000), "gm-1", make_bus("memory://"))
    assert gm.jobs.max_tasks == 5_000
