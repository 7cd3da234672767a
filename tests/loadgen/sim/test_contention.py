"""Issue 29: a full federation stays fair across GMs, and the reports show whether it does."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen import compare, report
from loadgen.experiment import EXPERIMENTS
from loadgen.experiment_contention import SCHEDULERS, SIZES, markdown_table, targets
from loadgen.sim.config import SimConfig
from loadgen.sim.run import simulate
from loadgen.trace import TraceJob, TraceTask


def backlog(jobs: int = 80, tasks: int = 10, gap_s: float = 0.05) -> list[TraceJob]:
    """Identical jobs, arriving far faster than the cluster runs them: every GM gets the
    same work (jobs go round-robin), so only the race for freed workers tells them apart."""
    return [
        TraceJob(f"j{j}", j * gap_s, tuple(TraceTask(1.0) for _ in range(tasks)))
        for j in range(jobs)
    ]


def test_summary_has_every_gms_tasks_and_allocation_times():
    result = simulate(SimConfig(workers=40, gms=4, lms=2), backlog(jobs=20))
    per_gm = result.summary["per_gm"]
    assert list(per_gm) == ["gm0", "gm1", "gm2", "gm3"]
    assert sum(g["tasks"] for g in per_gm.values()) == result.summary["completed"] == 200
    alloc = result.alloc_values_s()
    gm = result.log.gm[result.log.started()]
    for name, g in per_gm.items():
        mine = alloc[gm == int(name[2:])]
        assert g["mean_s"] == np.mean(mine) and g["p99_s"] == np.percentile(mine, 99)
    assert result.summary["alloc_mean_s"] == np.mean(alloc)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_freed_workers_are_shared_alike_by_gms_with_the_same_backlog(seed):
    # Every GM hears of every freed worker; delivered always in GM order, gm0 won every
    # race and its users waited least (issue 29: 17x apart; here 15x: 0.9 s to 14 s).
    # Live, no GM is always first, and in a seeded random order none is either.
    config = SimConfig(workers=40, gms=4, lms=2, seed=seed)
    summary = simulate(config, backlog()).summary
    assert summary["alloc_mean_s"] > 5.0  # the cluster really was full
    assert report.gm_spread(summary) < 2.0, summary["per_gm"]


def test_arrival_scale_compresses_the_arrivals():
    jobs = backlog(jobs=5, gap_s=10.0)
    plain = simulate(SimConfig(workers=100, gms=2, lms=2), jobs)
    fast = simulate(SimConfig(workers=100, gms=2, lms=2, arrival_scale=0.5), jobs)
    first = plain.workload.first[:-1]
    assert np.array_equal(
        fast.log.stamps["submitted"][first] - fast.log.stamps["submitted"][0],
        (plain.log.stamps["submitted"][first] - plain.log.stamps["submitted"][0]) // 2,
    )
    assert fast.summary["model"]["arrival_scale"] == 0.5


def test_a_run_past_its_wall_limit_stops_and_says_so():
    result = simulate(SimConfig(workers=40, gms=4, lms=2), backlog(jobs=400), wall_limit_s=1e-9)
    assert result.summary["timed_out"] is True
    assert result.summary["completed"] < result.summary["tasks"]
    assert "timed_out" not in simulate(SimConfig(workers=40), backlog(jobs=2)).summary


def test_compare_shows_the_per_gm_spread(tmp_path):
    from loadgen.sim.run import write_report

    result = simulate(SimConfig(workers=40, gms=4, lms=2), backlog(jobs=20))
    write_report(tmp_path / "run", result)
    run = compare.load_run(tmp_path / "run")
    spread = f"{report.gm_spread(result.summary):.2f}"
    assert "GM spread" in compare.table([run]) and spread in compare.table([run])
    assert spread in compare.markdown_table([run])


def test_contention_experiment_sweeps_the_sizes_and_checks_the_targets():
    configs = EXPERIMENTS["contention"].runs()
    kinds = {
        (
            c.scheduler + ("-owner" if c.scheduler == "megha" and c.claims == "owner" else ""),
            c.workers,
        )
        for c in configs.values()
    }
    assert kinds == {(s, w) for s in SCHEDULERS for w in SIZES}

    def summary(scheduler, mean, p99, spread_means=(1.0, 1.0), incons=0, p50=0.001):
        per_gm = {
            f"gm{i}": {"tasks": 10, "mean_s": m, "p99_s": m} for i, m in enumerate(spread_means)
        }
        return {
            "workers": 3000,
            "scheduler": scheduler,
            "completed": 100,
            "tasks": 100,
            "alloc_mean_s": mean,
            "alloc_s": {"p50": p50, "p99": p99},
            "per_gm": per_gm if scheduler == "megha" else {},
            "inconsistencies": incons,
            "wall_s": 1.0,
            "sim_tasks_per_wall_s": 10_000.0,
        }

    fair = [summary("megha", 10, 100), summary("central", 10, 100), summary("sparrow", 20, 200)]
    assert targets(fair) == ["3,000 workers, megha (overloaded): ok"]
    owner = {**fair[0], "model": {"claims": "owner"}}
    assert targets([*fair, owner]) == [
        "3,000 workers, megha (overloaded): ok",
        "3,000 workers, megha-owner (overloaded): ok",
    ]
    unfair = [summary("megha", 20, 300, (1.0, 3.0), incons=50), *fair[1:]]
    (line,) = targets(unfair)
    assert "mean 2.00x central's" in line and "p99 3.00x central's" in line
    assert "p99 1.50x Sparrow's" in line and "GM spread 3.00" in line
    assert "0.50 inconsistencies per task" in line
    light = [summary("megha", 0.001, 0.03, p50=0.004), summary("central", 0.001, 0.02)]
    assert targets(light) == ["3,000 workers, megha (light load): p50 4.00 ms; p99 30.00 ms"]
    assert "| 3,000 | megha | 100/100 | 20.0 | 300.0 | 3.00 | - | - | 0.500 |" in markdown_table(
        unfair
    )
    # Each GM's jobs against the same jobs under central: the worst-served GM's ratio.
    central = {**fair[1], "job_group_means": [2.0, 4.0], "job_group_spread": 2.0}
    spread = {**unfair[0], "job_group_means": [1.0, 4.4]}
    (line,) = targets([spread, central, fair[2]])
    assert "GM spread 3.00 (central, same job groups: 2.00; each GM's jobs at most 1.10x" in line
    table = markdown_table([spread, central, fair[2]])
    assert "| 3.00 | - | 1.10x | 0.500 |" in table and "| - | 2.00 | - | 0.000 |" in table


@pytest.mark.parametrize("claims", ["owner", "oldest"])
def test_ends_the_simulator_runs_through_two_gms_change_no_decision(monkeypatch, claims):
    """The simulator runs a task's end only through its GM, its node's owner and the
    claimant of its room (``OldestFirst``; the others only count the claim), as the
    others would hold the room until a snapshot shows it anyway: the same run with every
    GM running every end makes the very same decisions."""
    from loadgen.sim.megha import MeghaSim
    from services.core.scheduler import Scheduler

    jobs = [
        TraceJob(f"j{j}", j * 0.05, tuple(TraceTask(0.5 + (j * 7 + t) % 5) for t in range(9)))
        for j in range(80)
    ]
    config = SimConfig(workers=40, gms=4, lms=2, claims=claims)
    runs, ends = [], []
    real = Scheduler.ended
    for skip in (True, False):
        calls = 0

        def counted(self, *args, **kwargs):
            nonlocal calls
            calls += 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Scheduler, "ended", counted)
        monkeypatch.setattr(MeghaSim, "SKIP_IDLE_ENDS", skip)
        runs.append(simulate(config, jobs))
        ends.append(calls)
    skipped, every = runs
    assert skipped.summary["alloc_mean_s"] > 5.0  # the federation was full
    assert skipped.summary["repartitions"] > 0  # GMs took each other's nodes
    # Each end ran through 2.2 of the 4 GMs on average (every second a report names
    # claimants, often a third GM), not 4; at most 3 by construction.
    assert ends[0] < ends[1] * 0.6
    for name, stamps in every.log.stamps.items():
        assert np.array_equal(skipped.log.stamps[name], stamps), name
    assert np.array_equal(skipped.log.node, every.log.node)
    assert np.array_equal(skipped.log.lm, every.log.lm)
    assert skipped.summary["inconsistencies"] == every.summary["inconsistencies"]


def overtaken_s(result) -> float:
    """The longest any task waited for a task of its GM queued after it to start first."""
    log = result.log
    started = log.started()
    queued, start, gm = (
        log.stamps["queued"][started],
        log.stamps["started"][started],
        log.gm[started],
    )
    worst = 0
    for g in np.unique(gm):
        order = np.argsort(queued[gm == g], kind="stable")
        q, s = queued[gm == g][order], start[gm == g][order]
        first_later = np.append(np.minimum.accumulate(s[::-1])[::-1], np.iinfo(np.int64).max)
        worst = max(worst, int(np.max(s - first_later[np.searchsorted(q, q, side="right")])))
    return worst / 1e9


def test_a_gm_serves_its_own_work_in_the_order_it_was_queued():
    # Issue 29, the p99: a launch an LM refused went back to the front of its queue while
    # a younger backlog was parked; the view changed, the backlog went back ahead of it
    # and the refused task joined the tail of that backlog's run, so it waited behind
    # every younger job of its GM: 708 s here (9,900 s in the Yahoo sample at 3,000
    # workers, where the p99 fell from 7,741 s to 5,487 s once fixed; central: 5,564 s).
    result = simulate(SimConfig(workers=100, gms=4, lms=4, claims="oldest"), mixed_backlog())
    assert result.summary["inconsistencies"] > 0  # LMs did refuse launches
    assert overtaken_s(result) < 1.0


def mixed_backlog(seed: int = 1) -> list[TraceJob]:
    """300 jobs of 1-29 tasks of 1-40 s, one every 0.5 s: a full 100-worker federation."""
    rng = np.random.default_rng(seed)
    return [
        TraceJob(
            f"j{j}",
            j * 0.5,
            tuple(TraceTask(float(rng.uniform(1, 40))) for _ in range(int(rng.integers(1, 30)))),
        )
        for j in range(300)
    ]


def test_with_oldest_claims_the_claimant_takes_its_room_and_no_gm_races_it():
    # Issue 29: the claimant of an end whose task it never saw (placed and ended by
    # another GM between two of its snapshots) passed its room by, held for that GM since
    # the node's previous end; the next heartbeat offered the node to every GM at once
    # and they raced for it: 0.093 refused launches per task here (0.138 at 3,000 workers
    # on the Yahoo sample). The end's event names the node: the claimant's hold ends.
    result = simulate(SimConfig(workers=100, gms=4, lms=4, claims="oldest"), mixed_backlog())
    assert result.summary["alloc_mean_s"] > 100  # full
    assert result.summary["inconsistencies"] / result.summary["tasks"] < 0.04


def test_a_run_is_as_old_as_its_next_task_and_joins_no_younger_run():
    from loadgen.sim.megha import TaskRun

    queued = np.array([10, 20, 30, 5], dtype=np.int64) * 1_000_000_000
    specs = [None] * 4
    run = TaskRun([0, 1], 0, specs, queued)
    assert run.enqueued == 10.0
    run.take()
    assert run.enqueued == 20.0
    assert run.join(TaskRun([2], 0, specs, queued)) and len(run) == 2
    assert not run.join(TaskRun([3], 0, specs, queued))  # older than its tail: stays apart
    assert not run.join(TaskRun([2], 1, specs, queued))  # another shape


def test_group_means_split_the_jobs_as_the_megha_runs_do(tmp_path):
    from loadgen import report
    from loadgen.experiment_contention import group_means, group_spread, worst_vs

    rows = ["job_id,alloc_s", "a,1.0", "a,3.0", "b,4.0", "c,6.0", "c,", "d,10.0"]
    (tmp_path / report.TASKS_FILE).write_text("\n".join(rows) + "\n")
    # jobs in order of appearance: a -> 0, b -> 1, c -> 2, d -> 0 (3 groups)
    assert group_means(tmp_path, groups=3) == [(1.0 + 3.0 + 10.0) / 3, 4.0, 6.0]
    assert group_means(tmp_path, groups=5) == [2.0, 4.0, 6.0, 10.0, None]
    assert group_means(tmp_path / "none") is None
    assert group_spread([2.0, None, 8.0]) == 4.0 and group_spread([None, 1.0]) is None
    megha = {"scheduler": "megha", "job_group_means": [1.0, 9.0, None]}
    assert worst_vs(megha, {"job_group_means": [2.0, 6.0, 1.0]}) == 1.5
    assert worst_vs(megha, None) is None and worst_vs(megha, {"job_group_means": [1.0]}) is None


def test_a_burst_younger_than_a_heartbeat_takes_each_room_as_it_frees():
    """``OldestFirst`` reports all waiting work every ``backlog_interval_s`` (1 s), not
    only work a report interval old: gm1's burst, one second after gm0 filled the
    federation, is named the claimant of every end from its first report on, so each of
    its tasks starts as one of gm0's ends, on gm0's partition too. Reporting only work
    older than a 10 s heartbeat, ends there were held for gm0 (nothing waiting) until the
    LM's next snapshot: up to a heartbeat later (the 7,500-worker p99 of the sweep)."""
    full = TraceJob("j0", 0.0, tuple(TraceTask(5.0 + 0.1 * t) for t in range(40)))
    burst = TraceJob("j1", 1.0, tuple(TraceTask(1.0) for _ in range(40)))
    result = simulate(SimConfig(workers=40, gms=2, lms=2, claims="oldest"), [full, burst])
    log = result.log
    assert set(log.gm[:40]) == {0} and set(log.gm[40:]) == {1}
    ends = np.sort(log.stamps["finished"][:40])
    starts = np.sort(log.stamps["started"][40:])
    assert result.summary["repartitions"] > 0  # gm0 ran on gm1's partition and back
    assert np.all(starts - ends < 0.01e9), (starts - ends).max() / 1e9
