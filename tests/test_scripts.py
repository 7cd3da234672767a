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
