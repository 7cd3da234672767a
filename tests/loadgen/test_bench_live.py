"""``megha-loadgen bench-live``: what it counts from task events, its CLI errors, and one
small end-to-end run against real processes and RabbitMQ."""

from __future__ import annotations

import csv
import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from loadgen import cli, report
from loadgen.bench_live import (
    BenchError,
    BenchOptions,
    Offer,
    bench_config,
    histogram_from,
    render,
    stalls_from,
    summarise,
)
from loadgen.bench_sweep import parse_rates
from loadgen.events import AcceptedTasks, EventLog
from services._proto.megha.v1 import common_pb2

RABBIT_URL = os.environ.get("MEGHA_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
T0 = 1_800_000_000_000_000_000  # the first offer, unix ns
S = 1_000_000_000


def event(task_id: str, state: int, started_s: float, attempt: int = 0) -> common_pb2.TaskEvent:
    started = T0 + int(started_s * S)
    stamps = common_pb2.TaskTimestamps(
        submitted_unix_nanos=started - 5_000_000,
        queued_unix_nanos=started - 4_000_000,
        dequeued_unix_nanos=started - 3_000_000,
        decided_unix_nanos=started - 2_000_000,
        lm_received_unix_nanos=started - 1_500_000,
        lm_decided_unix_nanos=started - 1_000_000,
        worker_received_unix_nanos=started - 500_000,
        started_unix_nanos=started,
        finished_unix_nanos=started + 50_000_000 if state != common_pb2.TASK_STATE_RUNNING else 0,
    )
    return common_pb2.TaskEvent(
        task_id=task_id,
        job_id=task_id.split(".")[0],
        state=state,
        lm_id="lm-1",
        node_id="lm-1-w0",
        timestamps=stamps,
        attempt=attempt,
    )


def run_events(*events: common_pb2.TaskEvent) -> EventLog:
    log = EventLog()
    log.add(common_pb2.TaskEventBatch(events=list(events)))
    return log


RUNNING, SUCCEEDED = common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_SUCCEEDED


def test_summary_excludes_warmup_counts_duplicates_and_measures_the_steady_window() -> None:
    options = BenchOptions(rate=4, seconds=3, gms=1, lms=1, workers_per_lm=2, warmup_s=1.0)
    config = bench_config(options, base_port=30_000, prefix="bench-unit")
    offer = Offer(jobs=5, tasks=5, started_ns=T0, ended_ns=T0 + 2 * S)
    for name in "dbeac":  # not in id order: tasks.csv sorts
        offer.accepted.add(f"{name}.0", name, "gm-1")
    events = run_events(
        event("a.0", RUNNING, 0.5),  # in the warm-up
        event("b.0", RUNNING, 1.0),
        event("c.0", RUNNING, 1.5),
        event("d.0", RUNNING, 2.0),
        event("a.0", SUCCEEDED, 0.5),
        event("b.0", SUCCEEDED, 1.0),
        event("c.0", SUCCEEDED, 1.5),
        event("c.0", SUCCEEDED, 1.5),  # the same task succeeded twice
        event("d.0", SUCCEEDED, 2.0),
        # e.0 never ran
    )
    result = summarise(options, config, offer, events, wall_s=3.0, counters=None)
    s = result.summary
    assert list(s)[: len(report.SUMMARY_KEYS)] == list(report.SUMMARY_KEYS)
    assert (s["tasks"], s["completed"], s["duplicates"]) == (5, 4, 1)
    assert (s["measured_tasks"], s["excluded_warmup"]) == (3, 1)
    assert s["throughput_tasks_per_s"] == pytest.approx(3.0)  # 3 starts over 1 s
    assert s["alloc_s"]["p50"] == pytest.approx(0.005)
    assert s["components_s"]["framework_queuing"] == pytest.approx(0.002)
    assert s["counters_source"].startswith("unavailable")
    assert not result.ok
    rows = {r["task_id"]: r for r in result.rows}
    assert list(rows) == ["a.0", "b.0", "c.0", "d.0", "e.0"]  # tasks.csv in task id order
    assert rows["e.0"]["alloc_s"] is None and rows["e.0"]["state"] == "unspecified"
    assert rows["b.0"]["state"] == "succeeded" and rows["b.0"]["finished_unix_nanos"] > 0


def test_the_load_generators_maps_of_tasks_are_never_scanned_by_the_garbage_collector():
    # A run keeps a million tasks in them: a tracked map is walked, entry by entry, by
    # every full collection while the load is offered (~0.3 s at a million tasks).
    log, accepted = EventLog(), AcceptedTasks()
    for n in range(100):
        accepted.add(f"j.{n}", "j", "gm-1")
        log.add_event(event(f"j.{n}", RUNNING, 1.0))
        log.add_event(event(f"j.{n}", SUCCEEDED, 1.0))
    maps = [g for m in (log.running, log.ended, log.successes, accepted._job) for g in m._gens]
    assert not any(gc.is_tracked(m) for m in [*maps, accepted._gm])  # none since they filled
    assert accepted["j.7"] == ("j", "gm-1") and len(accepted) == 100 and "j.100" not in accepted
    running, ended = log.seen("j.7")
    assert (running.state, ended.state, ended.lm_id) == (RUNNING, SUCCEEDED, "lm-1")


def test_a_retried_task_is_measured_by_its_latest_attempt() -> None:
    log = run_events(event("a.0", RUNNING, 3.0, attempt=1), event("a.0", RUNNING, 1.0))
    assert log.seen("a.0")[0].attempt == 1
    assert log.succeeded == 0 and log.duplicates == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "0"], "--rate must be positive"),
        (["--warmup", "20", "--seconds", "10"], "--warmup must be"),
        (["--rabbitmq-url", "amqp://guest:guest@127.0.0.1:1/"], "RabbitMQ is not reachable"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(args, message, capsys) -> None:
    assert cli.main(["bench-live", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_without_a_subcommand_describes_itself(capsys) -> None:
    assert cli.main([]) == 0
    assert "bench-live" in capsys.readouterr().out


def test_stalls_are_read_from_each_process_histograms() -> None:
    registry = CollectorRegistry()
    edges = (0.128, 0.256, 0.512, 1.024)
    lag = Histogram("megha_event_loop_lag_seconds", "", buckets=edges, registry=registry)
    busy = Histogram("megha_event_loop_busy_lag_seconds", "", buckets=edges, registry=registry)
    pause = Histogram("megha_gc_pause_seconds", "", ["generation"], registry=registry)
    for seconds in (0.001, 0.2, 0.3, 0.9):
        lag.observe(seconds)
    for seconds in (0.001, 0.3):  # the loop's own work; 0.2 and 0.9 waited for a core
        busy.observe(seconds)
    pause.labels("2").observe(0.05)
    pause.labels("2").observe(0.07)
    quiet = CollectorRegistry()
    Histogram("megha_event_loop_lag_seconds", "", registry=quiet).observe(0.001)
    texts = {"lm-1": generate_latest(registry).decode(), "gm-1": generate_latest(quiet).decode()}
    texts["predictor"] = "# no watcher here\n"

    stalls = stalls_from(texts)

    assert stalls["lm-1"] == {
        "loop_lags": 4,
        "stalls": 3,  # 0.2, 0.3 and 0.9: over 0.128 s
        "busy_stalls": 1,  # 0.3
        "worst_lag_le_s": 1.024,
        "gc": {"2": [2, 0.12]},
    }
    assert stalls["gm-1"]["stalls"] == 0 and stalls["gm-1"]["gc"] == {}
    assert stalls["gm-1"]["busy_stalls"] == 0  # a process without the busy histogram
    assert "predictor" not in stalls


def test_stalls_count_from_the_scrape_before_the_load() -> None:
    """A process's start-up (connecting, ``settle``'s full collection) is not the run's:
    only what its histograms gained after the scrape taken when the load began counts."""
    registry = CollectorRegistry()
    edges = (0.128, 0.256, 0.512, 1.024)
    lag = Histogram("megha_event_loop_lag_seconds", "", buckets=edges, registry=registry)
    busy = Histogram("megha_event_loop_busy_lag_seconds", "", buckets=edges, registry=registry)
    pause = Histogram("megha_gc_pause_seconds", "", ["generation"], registry=registry)
    lag.observe(0.9)  # start-up
    busy.observe(0.9)
    pause.labels("2").observe(0.2)  # settle's collection
    lag.observe(0.001)
    before = {"gm-1": generate_latest(registry).decode()}
    for seconds in (0.001, 0.3):
        lag.observe(seconds)
        busy.observe(seconds)
    pause.labels("0").observe(0.01)
    after = {"gm-1": generate_latest(registry).decode()}

    assert stalls_from(after, before)["gm-1"] == {
        "loop_lags": 2,
        "stalls": 1,  # 0.3; the start-up's 0.9 is left out
        "busy_stalls": 1,
        "worst_lag_le_s": 0.512,
        "gc": {"0": [1, 0.01]},
    }
    assert stalls_from(after)["gm-1"]["stalls"] == 2  # without a baseline: since start


def test_a_histogram_is_summed_over_processes_and_read_as_bucket_bounds() -> None:
    texts = {}
    for name, seconds in (("gm-1", [0.001] * 60), ("gm-2", [0.3] * 39 + [200.0])):
        registry = CollectorRegistry()
        answers = Histogram(
            "megha_submission_answer_seconds", "", ["gm"], buckets=(0.002, 0.5), registry=registry
        )
        for took in seconds:
            answers.labels(name).observe(took)
        texts[name] = generate_latest(registry).decode()
    texts["lm-1"] = "# none here\n"

    # 60 of 100 within 2 ms, 39 more within 0.5 s, one beyond the last bucket.
    assert histogram_from(texts, "megha_submission_answer_seconds") == {
        "count": 100,
        "p50_le": 0.002,
        "p99_le": 0.5,
    }
    assert histogram_from(texts, "megha_broker_confirm_seconds") is None
    texts["gm-1"] = texts["gm-2"]  # now 78 within 0.5 s, 2 beyond: p99 past every bucket
    assert histogram_from(texts, "megha_submission_answer_seconds")["p99_le"] is None
    line = render_answers({"gm_answer_s": {"count": 2, "p50_le": 0.0016, "p99_le": None}})
    assert line.endswith("at the GMs p50 <= 1.60 ms, p99 > 100 s")


def render_answers(extra: dict) -> str:
    from loadgen.bench_live import _answers_line

    summary = {"submit_answer_s": {"p50": 0.001, "p99": 0.002, "max": 0.003}, **extra}
    return _answers_line(summary)


def run_cli(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MEGHA_RABBITMQ_URL": RABBIT_URL}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.mark.integration
def test_bench_live_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "loadgen.cli", "bench-live", "--gms", "1", "--lms", "1"]
    argv += ["--workers-per-lm", "4", "--rate", "20", "--seconds", "2", "--warmup", "0"]
    argv += ["--out", str(out), "--log-dir", str(tmp_path / "logs")]
    done = run_cli(argv, timeout_s=90)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary)[: len(report.SUMMARY_KEYS)] == list(report.SUMMARY_KEYS)
    assert summary["target"] == "live" and summary["scheduler"] == "megha"
    assert summary["tasks"] == 40
    assert summary["completed"] == summary["tasks"]
    assert summary["duplicates"] == 0
    assert summary["alloc_s"]["p50"] > 0 and summary["throughput_tasks_per_s"] > 0
    with (out / "tasks.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 40 and all(float(r["alloc_s"]) > 0 for r in rows)
    assert "completed / offered    40 / 40" in done.stdout
    # Each service's resident memory at both ends of the run, and its growth per task.
    rss = summary["memory"]["rss_mb"]
    assert {"gm-gm-1", "lm-lm-1", "workers-lm-1", "loadgen"} <= set(rss)
    assert all(10 < start < 2000 and 10 < end < 2000 for start, end in rss.values())
    assert set(summary["memory"]["kb_per_task"]) == set(rss)
    assert "memory, MB resident" in done.stdout
    series = summary["memory"]["series"]
    assert len(series["t_s"]) >= 10 and series["t_s"] == sorted(series["t_s"])
    assert all(len(values) == len(series["t_s"]) for values in series["rss_mb"].values())
    assert (out / "memory.png").stat().st_size > 0
    # Each process's stall watcher ran all along the run (every 50 ms); what a service did
    # before the load (its start-up's full collection in ``settle``) is not counted.
    stalls = summary["stalls"]
    assert set(stalls) == {"gm-1", "lm-1", "loadgen"}
    assert all(s["loop_lags"] >= 20 for s in stalls.values())
    assert all("2" not in s["gc"] for s in stalls.values())
    # How long the GM's scheduling rounds held its loop (each took work: the 40 tasks).
    assert summary["gm_round_s"]["count"] >= 1 and "GM rounds" in done.stdout
    assert "loop stalls > 0.128 s" in done.stdout
    # Where a submission's wait went: the GM's part (read to answer), the broker's confirm.
    assert summary["gm_answer_s"]["count"] == 40 and summary["gm_answer_s"]["p50_le"] > 0
    assert summary["broker_confirm_s"]["count"] >= 40
    assert "at the GMs p50 <= " in done.stdout


@pytest.mark.parametrize(
    ("text", "message"),
    [("0,10", "--rate must be positive"), ("10,x", "not a number"), ("5,5", "twice")],
)
def test_a_bad_rate_list_is_refused_before_anything_starts(text, message) -> None:
    with pytest.raises(BenchError, match=message):
        parse_rates(text)


@pytest.mark.slow  # ~14 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1), the default's budget
@pytest.mark.integration
def test_a_rate_sweep_runs_each_rate_and_draws_the_curve(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "loadgen.cli", "bench-live", "--gms", "1", "--lms", "1"]
    argv += ["--workers-per-lm", "4", "--rate", "10,20", "--seconds", "2", "--warmup", "0"]
    argv += ["--out", str(out)]
    done = run_cli(argv, timeout_s=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["offered_rate"] for r in rows] == [10, 20]
    assert [r["tasks"] for r in rows] == [20, 40]
    assert all(r["completed"] == r["tasks"] and r["duplicates"] == 0 for r in rows)
    assert all(r["alloc_s"]["p99"] > 0 for r in rows)
    for rate in ("10", "20"):
        assert json.loads((out / f"rate-{rate}" / "summary.json").read_text())["tasks"] > 0
    assert "offered/s" in done.stdout and "p99 ms" in done.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (out / "sweep.png").stat().st_size > 0


def test_an_overloaded_run_reports_its_refusals_and_passes_if_no_task_was_lost() -> None:
    options = BenchOptions(rate=4, seconds=3, gms=1, lms=1, workers_per_lm=2, warmup_s=1.0)
    config = bench_config(options, base_port=30_000, prefix="bench-unit")
    offer = Offer(jobs=5, tasks=5, started_ns=T0, ended_ns=T0 + 2 * S, busy_retries=3)
    offer.errors.update({"DEADLINE_EXCEEDED": 2, "RESOURCE_EXHAUSTED": 1})
    offer.answer_s.extend([0.01, 0.02])
    offer.turn_s[True].extend([0.5, 1.5])  # waited their turn at the client's gate
    offer.turn_s[False].append(24.0)  # waited, then refused unsent
    offer.not_admitted = 1
    offer.accepted.add("a.0", "a", "gm-1")
    offer.accepted.add("b.0", "b", "gm-1")
    events = run_events(
        event("a.0", SUCCEEDED, 1.2),
        event("b.0", SUCCEEDED, 1.5),
        event("c.0", SUCCEEDED, 1.7),  # its submission timed out, yet the GM queued it
    )
    result = summarise(options, config, offer, events, wall_s=3.0, counters=None)
    s = result.summary
    assert result.ok  # exit 0: saturated, measured
    assert s["verdict"]["kind"] == "saturated"
    assert (s["refused_tasks"], s["busy_retries"], s["unacknowledged_ran"]) == (3, 3, 1)
    text = render(result)
    assert "refused submissions    3 tasks not acknowledged" in text
    assert "DEADLINE_EXCEEDED 2  RESOURCE_EXHAUSTED 1" in text
    assert "verdict                saturated" in text
    assert (s["turn_waited_jobs"], s["turn_refused_jobs"], s["not_admitted_jobs"]) == (2, 1, 1)
    assert s["turn_waited_s"]["max"] == 1.5
    assert "2 jobs waited their turn at a client and had it: p50 1000.00 ms" in text
    assert "1 jobs waited their turn at a client and were refused unsent" in text
    assert "1 jobs never sent" in text

    # The same run with one acknowledged task lost is a breach, refusals or not.
    offer.accepted.add("d.0", "d", "gm-1")
    lost = summarise(options, config, offer, events, wall_s=3.0, counters=None)
    assert not lost.ok and lost.summary["verdict"]["kind"] == "breach"
    assert "EXACTLY-ONCE BREACH" in render(lost)
