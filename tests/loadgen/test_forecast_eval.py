"""forecast-eval: the synthetic demand has the documented shape, the series counts what runs,
the predictive autoscaler pends less than the reactive one, and --out writes forecast.json."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from loadgen import forecast_eval
from loadgen.demand_trace import (
    DEFAULT_BUCKETS,
    TaskDemand,
    bucket_series,
    synthetic_demand,
)
from loadgen.trace import TraceJob, TraceTask

SMALL = ["--days", "10", "--interval", "3600", "--tasks-per-hour", "300", "--refit-every", "48"]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    forecast_eval.add_subcommand(parser.add_subparsers(dest="command"))
    return parser.parse_args(["forecast-eval", *argv])


def test_synthetic_demand_has_daily_and_weekly_seasonality_and_is_seeded():
    demand = synthetic_demand(
        days=14, interval_s=3600, tasks_per_hour=400, bursts_per_day=0, seed=1
    )
    hour = (demand.start_s % 86_400) // 3600
    weekday = (demand.start_s // 86_400) % 7
    assert np.mean(hour == 15) > 2 * np.mean(hour == 4)  # afternoon peak vs night trough
    assert np.mean(weekday == 2) > 1.4 * np.mean(weekday == 6)  # Wednesday vs Sunday
    again = synthetic_demand(days=14, interval_s=3600, tasks_per_hour=400, bursts_per_day=0, seed=1)
    assert np.array_equal(demand.start_s, again.start_s)


def test_bucket_series_counts_the_tasks_running_in_each_interval():
    demand = TaskDemand(
        start_s=np.array([0.0, 100.0, 3600.0]),
        end_s=np.array([3600.0, 7300.0, 3700.0]),  # the first ends on a boundary
        vectors=np.array([[3000, 1024, 0, 0], [2000, 1024, 0, 0], [20000, 1024, 0, 0]]),
    )
    series = bucket_series(demand, DEFAULT_BUCKETS, 3600.0, intervals=3)
    # interval 0: 5 cores in the 4-core shape -> 2 nodes; interval 1: 2 cores -> 1 node,
    # and a 20-core task -> one 64-core node; interval 2: the 2-core task still runs.
    assert series.counts.tolist() == [[2, 0, 0], [1, 0, 1], [1, 0, 0]]


def test_run_and_outputs(tmp_path):
    args = _args(*SMALL, "--out", str(tmp_path))
    assert forecast_eval.main(args) == 0
    result = json.loads((tmp_path / "forecast.json").read_text())
    assert (tmp_path / "forecast.png").stat().st_size > 0
    names = [r["autoscaler"] for r in result["autoscalers"]]
    assert names[0] == "reactive" and "predictive_gbm" in names and names[-1] == "oracle"
    for key in ("pending_node_hours", "overprovisioned_node_hours"):
        assert result["predictive"][key] >= 0 and result["reactive"][key] >= 0
    rows = {r["autoscaler"]: r for r in result["autoscalers"]}
    # never below the demand it saw: every predictive pool is at least the reactive one
    for name in ("predictive_gbm", "predictive_gbm_q90", "predictive_seasonal"):
        assert rows[name]["pending_node_hours"] <= rows["reactive"]["pending_node_hours"]
    assert rows["predictive_gbm_q90"]["pending_node_hours"] < rows["reactive"]["pending_node_hours"]
    assert rows["oracle"]["pending_node_hours"] == 0
    assert {r["method"] for r in result["forecast_errors"]} >= {"naive", "seasonal", "gbm"}
    # deterministic for a seed
    again = tmp_path / "again"
    assert forecast_eval.main(_args(*SMALL, "--out", str(again))) == 0
    assert json.loads((again / "forecast.json").read_text()) == result


def test_a_trace_file_and_bad_input(tmp_path, capsys):
    jobs = [
        TraceJob(
            f"j{i}", float(i * 600), tuple(TraceTask(duration_s=1800.0) for _ in range(1 + i % 5))
        )
        for i in range(300)
    ]
    path = tmp_path / "tiny.tr"
    path.write_text(
        "".join(
            f"{j.arrival_s} {len(j.tasks)} 1800 {' '.join('1800' for _ in j.tasks)}\n" for j in jobs
        )
    )
    args = _args("--trace", str(path), "--interval", "1800", "--quantile", "0")
    assert forecast_eval.main(args) == 0
    assert "predictive_gbm" in capsys.readouterr().out
    assert forecast_eval.main(_args("--bucket", "cpu=4,gpu=1")) == 2
    assert "unknown resource 'gpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        _args(*SMALL, "--train-fraction", "1.0")
    assert "argument --train-fraction: must be > 0 and < 1, got 1.0" in capsys.readouterr().err
