"""Gangs and Gridiron VDCs in the simulator (issue 33): the core's plan_gang and
Reservations in virtual time."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from loadgen import report
from loadgen.augment import gridiron_bandwidth
from loadgen.cli import main
from loadgen.sim.config import SimConfig, SimConfigError
from loadgen.sim.run import WALL_KEYS, simulate
from loadgen.trace import TraceJob, TraceTask


def jobs(count: int = 30, gap_s: float = 0.2, most: int = 12) -> list[TraceJob]:
    rng = np.random.default_rng(11)
    return [
        TraceJob(
            f"j{j}",
            j * gap_s,
            tuple(
                TraceTask(float(d))
                for d in rng.uniform(0.5, 3.0, size=int(rng.integers(2, most + 1)))
            ),
        )
        for j in range(count)
    ]


def spans(result, trace: list[TraceJob]) -> list[tuple[int, int, int]]:
    """Per job: (first start, last start, first end), virtual ns."""
    stamps = result.log.stamps
    out, lo = [], 0
    for job in trace:
        hi = lo + len(job.tasks)
        started, finished = stamps["started"][lo:hi], stamps["finished"][lo:hi]
        out.append((int(started.min()), int(started.max()), int(finished.min())))
        lo = hi
    return out


def test_no_task_of_a_gang_starts_before_all_of_it_is_committed():
    # 24 one-core workers, gangs of up to 12 arriving fast: gangs wait for each other.
    trace = jobs()
    result = simulate(SimConfig(workers=24, gms=2, lms=3, gangs=True), trace)
    assert result.summary["completed"] == result.summary["tasks"]
    for first, last, first_end in spans(result, trace):
        # Started together (the commits reach the LMs one delay after the last reserve
        # answer), so every member ran before any of them ended.
        assert last - first < 1_000_000 and last < first_end


def test_the_same_seed_gives_the_same_gang_run():
    config = SimConfig(workers=24, gms=2, lms=3, gangs=True, seed=5)
    first, second = simulate(config, jobs()), simulate(config, jobs())
    drop = set(WALL_KEYS)
    assert {k: v for k, v in first.summary.items() if k not in drop} == {
        k: v for k, v in second.summary.items() if k not in drop
    }


def test_a_gang_larger_than_the_federation_is_refused_at_arrival():
    trace = [TraceJob("big", 0.0, tuple(TraceTask(1.0) for _ in range(9))), *jobs(3, most=4)]
    result = simulate(SimConfig(workers=8, gms=1, lms=2, gangs=True), trace)
    assert result.log.infeasible[:9].all() and not result.log.infeasible[9:].any()
    assert result.summary["completed"] == result.summary["tasks"] - 9


def test_vdc_aware_placement_admits_what_per_task_net_mbps_cannot():
    # 12 one-core tasks a job, bpc 100: per task 11 x 100 = 1,100 Mbit/s, over a 1,000
    # Mbit/s uplink: never placed task by task. As a VDC, 12 on one 16-core node send
    # nothing over the uplink.
    trace = gridiron_bandwidth(
        [TraceJob(f"j{j}", j * 1.0, tuple(TraceTask(1.0) for _ in range(12))) for j in range(4)],
        100,
        peak_vdc=30,
        uplink_mbps=40_000,
    )
    common = {"workers": 4, "gms": 1, "lms": 2, "cores_per_worker": 16, "uplink_mbps": 1000}
    per_task = simulate(SimConfig(**common), trace)
    assert per_task.log.infeasible.all()
    vdc = simulate(SimConfig(**common, gangs=True, vdc=(100, 177)), trace)
    assert not vdc.log.infeasible.any()
    assert vdc.summary["completed"] == 48


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scheduler": "sparrow", "gangs": True}, "no gangs"),
        ({"gang_queues": ("q",)}, "set gangs"),
        ({"gangs": True, "gang_queues": ("nowhere",)}, "not configured"),
        ({"vdc": (100, 177)}, "set gangs as well"),
        ({"gangs": True, "vdc": (-1, 177)}, "bandwidth_per_core must be finite and >= 0"),
        ({"gangs": True, "gang_ttl_s": 61.0}, "within the LM's bounds 0.1-60 s"),
    ],
)
def test_bad_gang_settings_say_why(overrides, message):
    with pytest.raises(SimConfigError, match=message):
        SimConfig(**overrides).check()


def test_simulate_gangs_from_the_command_line(tmp_path):
    # One job of 12 one-core tasks under --gridiron (bpc 100: 1,100 Mbit/s per task over
    # 1,000 Mbit/s uplinks): task by task it never fits; as a VDC gang it runs.
    trace = tmp_path / "one.tr"
    trace.write_text("0.0 12 1.0 " + " ".join(["1.0"] * 12) + "\n")
    base = ["simulate", str(trace), "--workers", "4", "--gms", "1", "--lms", "2"]
    base += ["--cores-per-worker", "16", "--worker-uplink-mbps", "1000", "--bpc", "100"]
    summaries = {}
    for name, extra in (("per_task", []), ("vdc", ["--gangs"])):
        out = tmp_path / name
        assert main([*base, *extra, "--out", str(out), "--quiet"]) == 0
        summaries[name] = json.loads((out / report.SUMMARY_FILE).read_text())
    assert summaries["per_task"]["infeasible"] == 12 and summaries["per_task"]["completed"] == 0
    assert summaries["vdc"]["completed"] == 12
    assert summaries["vdc"]["gangs"] == {"started": 1, "refused_attempts": 0, "infeasible": 0}


def test_gangs_in_a_limited_queue_start_whole_within_the_limit():
    """The simulator plans gangs as the GM does (``Scheduler.plan_gang``): a queue capped
    at 6 cores holds at most 6 however many gangs wait, a gang of more than 6 tasks is
    refused at arrival, and every other gang still starts whole."""
    from services.common.config import QueueConfig

    queues = (
        QueueConfig(name="capped", share=0.5, gm="gm-1", limit="cpu=6"),
        QueueConfig(name="open", share=0.5, gm="gm-2"),
    )
    trace = jobs(40, gap_s=0.05, most=8)
    config = SimConfig(workers=24, gms=2, lms=3, gangs=True, queues=queues, seed=3)
    result = simulate(config, trace)
    s = result.summary
    capped = s["queues"]["capped"]
    assert capped["limit"] == "cpu=6" and 0 < capped["peak_cpu_milli"] <= 6_000
    assert s["queues"]["open"]["peak_cpu_milli"] > 6_000
    refused = int(result.log.infeasible.sum())
    assert refused > 0 and s["completed"] == s["tasks"] - refused
    starts = np.cumsum([0] + [len(j.tasks) for j in trace])
    for lo, (first, last, first_end) in zip(starts, spans(result, trace), strict=False):
        if not result.log.infeasible[lo]:  # started whole
            assert last - first < 1_000_000 and last < first_end
    unlimited = tuple(q.model_copy(update={"limit": ""}) for q in queues)
    free = simulate(replace(config, queues=unlimited), trace).summary
    assert free["queues"]["capped"]["peak_cpu_milli"] > 6_000


def gangs_behind_batch() -> tuple[tuple, list[TraceJob], dict]:
    """Queues batch and train (half each), a trace and the simulator's settings: 16
    one-core workers, batch fills them all with 100 s tasks, then three gangs of 4 (30 s
    tasks) arrive on train, one every 2 s."""
    from services.common.config import QueueConfig

    queues = (
        QueueConfig(name="batch", share=0.5, gm="gm-1"),
        QueueConfig(name="train", share=0.5, gm="gm-2"),
    )
    trace = [TraceJob("b", 0.0, tuple(TraceTask(100.0) for _ in range(16)), user="batch")]
    trace += [
        TraceJob(f"g{i}", 5.0 + 2 * i, tuple(TraceTask(30.0) for _ in range(4)), user="train")
        for i in range(3)
    ]
    common = {"workers": 16, "gms": 2, "lms": 2, "gangs": True, "gang_queues": ("train",)}
    return queues, trace, common


def test_a_waiting_gang_preempts_an_over_share_queue_as_one_unit():
    """With shares, a gang that finds no room preempts as the live GM's does
    (``Scheduler.gang_evictions``, ``Lifecycle.evictable``): tasks of the queue over its
    share, never a gang's, and only while its own queue stays within its share; it then
    starts whole in their room, long before the victims would have ended. Without
    fairness every gang waits for them."""
    queues, trace, common = gangs_behind_batch()
    fair = simulate(SimConfig(**common, queues=queues, fair_share=True, seed=1), trace)
    s = fair.summary
    assert s["completed"] == 28
    # Two gangs bring train to its half: 4 victims each, all batch's; the third gang
    # would take train past its share, so it waits for one of them to end.
    assert s["queues"]["batch"]["preemptions"] == 8
    assert s["queues"]["train"]["preemptions"] == 0  # a gang is never a victim
    assert s["queues"]["train"]["peak_cpu_milli"] == 8_000
    gangs = spans(fair, trace)[1:]
    for first, last, ended in gangs:
        assert last - first < 0.01e9 < ended - last  # whole, before any member ended
    for job, (first, _, _) in zip(trace[1:3], gangs[:2], strict=True):
        assert first < (job.arrival_s + 2.0) * 1e9  # at once, not after batch's 100 s
    assert gangs[2][0] >= gangs[0][2]  # the third once the first ended
    # Without fairness (the same queues) the gangs wait for batch's tasks to end.
    plain = simulate(SimConfig(**common, queues=queues), trace)
    assert plain.summary["preemptions"] == 0
    assert min(first for first, _, _ in spans(plain, trace)[1:]) >= 100e9


def test_every_gm_hears_every_victim_a_gang_evicted():
    """The live LM publishes PREEMPTED for each victim it stops for a gang: each of
    the two GMs hears each of the 8 victims' ends, as it hears each of the 28 tasks'
    (a late job keeps the run going until every notice was delivered). The simulator
    told the GMs of one victim per LM it asked, its last, even one it had not stopped."""
    queues, trace, common = gangs_behind_batch()
    trace.append(TraceJob("late", 1000.0, (TraceTask(1.0),), user="batch"))
    s = simulate(SimConfig(**common, queues=queues, fair_share=True, seed=1), trace).summary
    assert s["completed"] == 29 and s["preemptions"] == 8
    assert s["megha"]["finish_notices"] == 2 * (28 + 8)  # the late job's end stops the run


def test_gang_queues_from_the_command_line(tmp_path, capsys):
    trace = tmp_path / "two.tr"
    trace.write_text("0.0 2 1.0 1.0 1.0\n1.0 2 1.0 1.0 1.0\n")
    queues = tmp_path / "queues.yaml"
    queues.write_text(
        "- {name: batch, share: 0.5, gm: gm-1}\n- {name: train, share: 0.5, gm: gm-2}\n"
    )
    base = ["simulate", str(trace), "--workers", "4", "--gms", "2", "--lms", "2", "--quiet"]
    base += ["--gangs", "--queues", str(queues)]
    assert main([*base, "--gang-queues", "nowhere"]) == 2
    assert "gang_queues names queues not configured: ['nowhere']" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main([*base, "--gang-queues", "train", "--out", str(out)]) == 0
    summary = json.loads((out / report.SUMMARY_FILE).read_text())
    assert summary["model"]["gang_queues"] == ["train"]
    assert summary["completed"] == 4
