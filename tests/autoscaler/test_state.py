"""What ``megha autoscale`` keeps across restarts (the demand history, the nodes it
started) and which forecast it asks for."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from services._proto.megha.v1 import predictor_pb2
from services.autoscaler.service import History, NodeProcess, forecast_method


def test_history_survives_a_restart_and_keeps_the_newest(tmp_path):
    path = tmp_path / "history.jsonl"
    history = History(path, ["a", "b"], keep=3)
    for t in range(8):
        history.add(100.0 + t, [t, 2 * t])
    again = History(path, ["a", "b"], keep=3)
    assert again.samples == [(105.0, [5, 10]), (106.0, [6, 12]), (107.0, [7, 14])]
    again.add(50.0, [1, 1])  # the clock stepped back: still after the last sample
    assert again.samples[-1][0] > 107.0


def test_a_history_of_other_pools_is_set_aside_not_mixed_in(tmp_path):
    path = tmp_path / "history.jsonl"
    History(path, ["a"], keep=10).add(1.0, [4])
    fresh = History(path, ["a", "gpu"], keep=10)
    assert fresh.samples == [] and not path.exists()
    (aside,) = tmp_path.glob("history.*.old")
    assert json.loads(aside.read_text())["nodes"] == [4]


def test_seasonal_methods_wait_for_a_day_of_history_and_react_until_then():
    day = 24 * 60  # one-minute intervals
    naive, seasonal = predictor_pb2.FORECAST_METHOD_NAIVE, predictor_pb2.FORECAST_METHOD_SEASONAL
    assert forecast_method("seasonal", day, 60.0) == naive
    assert forecast_method("seasonal", day + 1, 60.0) == seasonal
    assert forecast_method("reactive", 10**6, 60.0) == naive
    auto = predictor_pb2.FORECAST_METHOD_UNSPECIFIED
    assert forecast_method("auto", 1, 60.0) == auto  # the predictor picks what fits


def test_an_adopted_node_is_known_by_its_pool_and_slot_not_its_pid_alone():
    argv = [sys.executable, "-c", "import time; time.sleep(30)", "--pool", "burst", "--slot", "2"]
    proc = subprocess.Popen(argv)
    try:
        # Until the child has exec'd, /proc shows the parent's command line (a loaded
        # machine took long enough for the check to read it).
        deadline = time.monotonic() + 10
        while not NodeProcess("burst", 2, proc.pid).running():
            assert time.monotonic() < deadline, "the node process never showed its arguments"
            time.sleep(0.01)
        assert not NodeProcess("burst", 1, proc.pid).running()  # a reused pid
        assert not NodeProcess("gpu", 2, proc.pid).running()
    finally:
        proc.kill()
        proc.wait()
    assert not NodeProcess("burst", 2, proc.pid).running()
