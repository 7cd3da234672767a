"""``megha-loadgen simulate`` and ``compare`` as a user runs them."""

from __future__ import annotations

import json

import pytest

from loadgen import report
from loadgen.cli import main

TRACE = """0.0 4 1.0 1.0 1.0 1.0 1.0
0.5 2 2.0 2.0 2.0
1.0 3 0.5 0.5 0.5 0.5
"""


def test_simulate_writes_the_report_and_compare_overlays_runs(tmp_path, capsys):
    trace = tmp_path / "small.tr"
    trace.write_text(TRACE)
    for scheduler in ("megha", "sparrow"):
        out = tmp_path / scheduler
        code = main(
            [
                "simulate",
                str(trace),
                "--workers",
                "20",
                "--gms",
                "2",
                "--lms",
                "2",
                "--scheduler",
                scheduler,
                "--out",
                str(out),
                "--quiet",
            ]
        )
        assert code == 0
        summary = json.loads((out / report.SUMMARY_FILE).read_text())
        assert summary["completed"] == summary["tasks"] == 9
        assert summary["scheduler"] == scheduler and summary["target"] == "sim"
        assert (out / report.CDF_FILE).stat().st_size > 0
    plot = tmp_path / "cmp.png"
    assert (
        main(["compare", str(tmp_path / "megha"), str(tmp_path / "sparrow"), "--out", str(plot)])
        == 0
    )
    table = capsys.readouterr().out
    assert "sim megha, 20 workers, 2x2" in table and "sim sparrow, 20 workers" in table
    assert plot.stat().st_size > 0


def test_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    trace = tmp_path / "bad.tr"
    trace.write_text("0.0 two 1.0 1.0\n")
    assert main(["simulate", str(trace), "--strict", "--quiet"]) == 2
    assert "bad.tr" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.tr"), "--quiet"]) == 2
    # Without --strict, a trace of nothing but bad lines says what was skipped.
    assert main(["simulate", str(trace), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "skipped 1 malformed lines" in err and "no jobs in" in err
    assert main(["experiment", "fig6", "--trace", str(trace), "--out", str(tmp_path)]) == 2
    assert "no jobs in" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["simulate", str(trace), "--workers", "0", "--quiet"])
    assert "argument --workers: must be > 0, got 0" in capsys.readouterr().err
    assert main(["compare", str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
