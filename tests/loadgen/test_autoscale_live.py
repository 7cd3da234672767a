"""``megha-loadgen autoscale-live`` end to end (one small burst, both modes) and its
refusals of bad options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"


def run_cli(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MEGHA_RABBITMQ_URL": RABBIT_URL}
    argv = [sys.executable, "-m", "loadgen.cli", "autoscale-live", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.mark.slow  # ~40 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1), the default's budget
@pytest.mark.integration
def test_autoscale_starts_tasks_sooner_and_reports_what_the_pool_cost(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--bursts", "1", "--burst-tasks", "10", "--task-s", "4", "--static", "1"]
    args += ["--interval-s", "0.5", "--idle-s", "1", "--out", str(out)]
    done = run_cli(args, timeout_s=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["mode"]: r for r in json.loads((out / "autoscale.json").read_text())["modes"]}
    static, scaled = rows["static"], rows["autoscale"]
    assert static["completed"] == scaled["completed"] == 10
    # 2 static CPUs: five waves of 4 s; the pool (2 nodes of 4 CPUs) takes the other 8.
    assert static["alloc_s"]["max"] > 15 and static["pool_node_s"] == 0
    assert scaled["alloc_s"]["max"] < 8 and scaled["pool_peak"] == 2
    assert scaled["pool_node_s"] > 0 and scaled["makespan_s"] < static["makespan_s"]
    timeline = json.loads((out / "timeline.json").read_text())
    assert timeline["autoscale"][-1][2] == 0  # the pool drained back to nothing
    assert (out / "autoscale.png").stat().st_size > 0
    assert "autoscale      10/10" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--modes", "static,elastic"], "--modes: choose from static, autoscale"),
        (["--pool-capacity", "cpu=lots"], "--pool-capacity cpu=lots: cannot read cpu quantity"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(args, message) -> None:
    done = run_cli(args, timeout_s=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
