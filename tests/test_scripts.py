"""The memory benchmarks in ``scripts/`` run, small, and print what their docstrings say."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def test_ended_bench_fills_the_book_past_its_bound():
    out = _run("ended_bench.py", "--endings", "30000", "--bound", "10000")
    assert (out["endings"], out["bound"]) == (30_000, 10_000)
    assert out["mb_every_100000"][-1][0] == 30_000
    assert out["us_per_lookup_unknown"] > 0 and out["us_per_insert"] > 0


def test_jobbook_bench_reports_a_full_book():
    out = _run("jobbook_bench.py", "--tasks", "5000")
    assert out["tasks"] == 5_000
    assert out["kb_per_task"] >= 0 and out["full_collection_ms"] >= 0


def test_output_bench_times_both_ways():
    out = _run(
        "output_bench.py", "--attempts", "50", "--keep", "20", "--rounds", "1", "--tasks", "3"
    )
    assert (out["attempts"], out["keep"]) == (50, 20)
    assert out["us_per_attempt_open"] > 0 and out["ms_start_over_files"] >= 0
    assert len(out["ms_per_task_kept"]) == len(out["ms_per_task_discarded"]) == 1


def test_slow_tasks_groups_the_slow_ones_into_episodes(tmp_path):
    header = (
        "task_id,job_id,gm,lm_id,node_id,submitted_unix_nanos,dequeued_unix_nanos,"
        "decided_unix_nanos,lm_received_unix_nanos,lm_decided_unix_nanos,"
        "worker_received_unix_nanos,started_unix_nanos,finished_unix_nanos,alloc_s,"
        "queued_unix_nanos,attempt,state"
    )
    ms = 1_000_000
    rows = []
    for n, (at_s, queued_for_ms) in enumerate([(0, 1), (5, 1), (5, 80)]):
        sub = at_s * 1000 * ms
        stamps = [sub + (queued_for_ms + 1 + k) * ms for k in range(7)]  # dequeued .. finished
        started = stamps[5]
        rows.append(
            f"j{n}.0,j{n},gm-1,lm-1,w0,{sub},{','.join(map(str, stamps))},"
            f"{(started - sub) / 1e9},{sub + ms},0,succeeded"
        )
    path = tmp_path / "tasks.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "slow_tasks.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "1 of 3 allocated tasks over 50 ms"
    assert lines[1].startswith("at      5 s:    1 tasks of 1 jobs (j2; gm-1), 0 later attempts")
    assert "broker 80.0" in lines[2]


def test_limits_bench_times_the_round_ledger_and_the_recount():
    args = ["--lms", "2", "--tasks", "50", "--rounds", "3"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "limits_bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0].startswith("2 LMs x 50 tasks: ledger ") and lines[0].endswith(" µs a round")
    assert lines[1].startswith("set+pop of one allocation, HeldAllocations: ")


def test_autoscale_bench_times_the_gms_walk_of_its_waiting_tasks():
    args = ["--tasks", "200", "--shapes", "3", "--repeats", "2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "autoscale_bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (line,) = done.stdout.splitlines()
    assert line.startswith("200 waiting tasks, 12 shapes: waiting_shapes ")  # 3 in 4 queues
    assert " with limits " in line and line.endswith(" µs")
