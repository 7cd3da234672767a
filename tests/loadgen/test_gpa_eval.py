"""gpa-eval: deterministic for a seed, the documented outputs, usage from CSV or synthetic."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from loadgen import gpa_eval
from loadgen.usage import SHAPES, UsageError, read_usage_csv, synthetic_usage

TINY = {"instances": 2, "tasks": 80, "realisations": 24}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpa_eval.add_subcommand(parser.add_subparsers(dest="command"))
    return parser.parse_args(["gpa-eval", *argv])


def test_tiny_run_is_deterministic_for_a_seed():
    first = gpa_eval.run_gpa_eval(**TINY, seed=7)
    assert first == gpa_eval.run_gpa_eval(**TINY, seed=7)
    assert first != gpa_eval.run_gpa_eval(**TINY, seed=8)
    expected = [(m, float(p)) for m, params in gpa_eval.METHODS.items() for p in params]
    assert [(r["method"], r["param"]) for r in first] == expected
    for row in first:
        assert row["m"] > 0 and 0 <= row["q"] <= 1
        assert (row["rel_error"] is None) == (row["method"] != "gpa")


def test_more_conservative_settings_use_more_machines():
    rows = gpa_eval.run_gpa_eval(**TINY, seed=1)
    for method in ("gpa", "av", "perc", "cantelli"):
        series = [r for r in rows if r["method"] == method]  # most permissive first
        machines = [r["machines"] for r in series]
        assert machines == sorted(machines), method


def test_main_writes_gpa_json_and_plot(tmp_path: Path, capsys):
    out = tmp_path / "out"
    args = _args("--instances", "2", "--tasks", "60", "--realisations", "20", "--out", str(out))
    assert gpa_eval.main(args) == 0
    rows = json.loads((out / "gpa.json").read_text())
    assert len(rows) == 16
    for row in rows:
        assert {"method", "param", "m", "q"} <= row.keys()
    gpa_row = next(r for r in rows if r["method"] == "gpa" and r["param"] == 0.05)
    assert gpa_row["rel_error"] == pytest.approx((gpa_row["q"] - 0.05) / 0.05, abs=1e-3)
    assert (out / "gpa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "(q-rho)/rho" in printed and "target: GPA rho=0.1" in printed


def test_violations_are_counted_per_machine_and_step():
    bins = np.array([0, 0, 1])
    evaluation = np.array([[0.5, 0.7, 0.1], [0.4, 0.4, 0.1], [1.2, 0.2, 0.3]])
    # machine 0 sums to 0.9, 1.1, 0.2; machine 1 is 1.2, 0.2, 0.3: 2 of 6 pairs exceed 1
    assert gpa_eval.evaluate_packing(bins, evaluation, 1.0) == (2, pytest.approx(2 / 6))


def test_synthetic_usage_mixes_shapes_within_bounds():
    rng = np.random.default_rng(3)
    usage = synthetic_usage(400, 50, rng)
    assert usage.shape == (400, 50) and usage.min() >= 0 and usage.max() <= 1
    np.testing.assert_array_equal(usage, synthetic_usage(400, 50, np.random.default_rng(3)))
    # one shape only: no task varies; the mix has every kind of spread
    assert len(SHAPES) == 4
    uniform = synthetic_usage(50, 400, rng, shape_weights=(0, 0, 1, 0))
    cv = uniform.std(axis=1) / uniform.mean(axis=1)
    assert (cv < 0.65).all()  # U(L(1 - w), L(1 + w)), w <= 1: cv <= 1/sqrt(3)
    skewed = synthetic_usage(50, 400, rng, shape_weights=(0, 1, 0, 0))
    assert np.median(skewed.std(axis=1) / skewed.mean(axis=1)) > 0.8  # exponential-like
    near_zero = synthetic_usage(50, 200, rng, shape_weights=(1, 0, 0, 0))
    assert np.median(near_zero) < 0.2 * near_zero.mean()  # mostly idle, with bursts


def test_usage_csv_reader(tmp_path: Path):
    path = tmp_path / "usage.csv"
    path.write_text("task_id,sample\na,0.1\nb,0.5\na,0.2\nb,0.6\na,0.3\nc,0.9\n")
    with pytest.raises(UsageError, match="task 'c' has 1"):
        read_usage_csv(path)  # every task is cut to the shortest: too short to split
    ids, samples = read_usage_csv(path, realisations=2)
    assert ids == ["a", "b"]
    np.testing.assert_array_equal(samples, [[0.1, 0.2], [0.5, 0.6]])
    path.write_text("a,0.1\na,oops\n")
    with pytest.raises(UsageError, match=r"usage.csv:2: sample 'oops'"):
        read_usage_csv(path)


def test_main_reads_usage_from_csv(tmp_path: Path, capsys):
    rng = np.random.default_rng(0)
    lines = [f"t{i},{v:.5f}" for i in range(30) for v in rng.uniform(0, 0.05, 12)]
    path = tmp_path / "usage.csv"
    path.write_text("\n".join(lines) + "\n")
    assert gpa_eval.main(_args("--instances", "2", "--usage-csv", str(path))) == 0
    assert "30 tasks x 12 realisations" in capsys.readouterr().out
    assert gpa_eval.main(_args("--usage-csv", str(tmp_path / "missing.csv"))) == 2
    assert "cannot read" in capsys.readouterr().err


def _row(method: str, param: float, m: float, q: float, violations: int = 100) -> dict:
    rel = (q - param) / param if method == "gpa" else None
    return {"method": method, "param": param, "m": m, "q": q, "rel_error": rel,
            "machines": 10 * m, "violations": violations}  # fmt: skip


def test_at_comparable_q_reads_gpa_curve_at_perc_95s_q():
    rows = [
        _row("gpa", 1e-3, 1.5, 1e-3),
        _row("gpa", 1e-6, 1.9, 1e-5),
        _row("gpa", 1e-9, 2.5, 0.0, violations=0),  # no place on a log-q curve
        _row("perc", 90.0, 1.9, 1e-4),
        _row("perc", 95.0, 2.3, 1e-4, violations=12),
    ]
    cmp = gpa_eval.at_comparable_q(rows)
    assert cmp["nearest"]["param"] == 1e-3  # 1 decade away; 1e-6 is 1 decade too, later
    assert cmp["gpa_m_at_q"] == pytest.approx(1.7)  # halfway in log q between 1e-3 and 1e-5
    assert cmp["gpa_q_range"] == (1e-5, 1e-3)
    lines = gpa_eval.format_comparable_q(cmp)
    assert "12 violating machine-steps, few: a rough q" in lines[0]
    assert lines[1].endswith("m=1.700 vs perc 95 m=2.300: 26.1% fewer machines")
    target = gpa_eval.check_targets(rows)[-1]
    assert target[0] == "GPA fewer machines than perc 95 at comparable q" and target[1] is True
    # Out of GPA's range: no interpolation, no verdict unless a row is within 2x.
    rows[-1] = _row("perc", 95.0, 2.3, 1e-7)
    cmp = gpa_eval.at_comparable_q(rows)
    assert (
        cmp["gpa_m_at_q"] is None and "cannot interpolate" in gpa_eval.format_comparable_q(cmp)[1]
    )
    assert gpa_eval.check_targets(rows)[-1][1] is None
    assert gpa_eval.at_comparable_q([r for r in rows if r["method"] != "perc"]) is None
    no_violation = [_row("gpa", 1e-3, 1.5, 0.0, violations=0), rows[-1]]
    cmp = gpa_eval.at_comparable_q(no_violation)
    assert (
        cmp["nearest"] is None
        and "no GPA row has a violation" in gpa_eval.format_comparable_q(cmp)[0]
    )
    assert gpa_eval.check_targets(no_violation) == []


def test_extra_rho_adds_gpa_rows_of_the_same_schema(tmp_path: Path, capsys):
    out = tmp_path / "out"
    args = _args("--instances", "2", "--tasks", "400", "--realisations", "40",
                 "--extra-rho", "1e-5,1e-7", "--out", str(out))  # fmt: skip
    assert args.extra_rho == (1e-5, 1e-7)
    assert gpa_eval.main(args) == 0
    rows = json.loads((out / "gpa.json").read_text())
    assert len(rows) == 18
    assert [r["param"] for r in rows if r["method"] == "gpa"] == [
        0.1,
        0.05,
        0.01,
        0.001,
        1e-5,
        1e-7,
    ]
    assert {frozenset(r) for r in rows} == {frozenset(rows[0])}
    for row in rows:
        assert (row["violations"] > 0) == (row["q"] > 0)
    printed = capsys.readouterr().out
    assert "1e-07" in printed and "at comparable q: perc 95 m=" in printed
    for bad in ("0", "1e-5,x", "2"):
        with pytest.raises(SystemExit):
            _args("--extra-rho", bad)
