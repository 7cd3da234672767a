"""The Sparrow / Megha ``.tr`` reader: the real Yahoo sample and malformed lines."""

import gzip
from pathlib import Path

import pytest

from loadgen.trace import ReadStats, TraceError, read_tr

YAHOO = Path("/work/shared/traces/yahoo_YH1_sub.tr")


@pytest.mark.skipif(not YAHOO.exists(), reason=f"the Yahoo sample {YAHOO} is not on this machine")
def test_yahoo_sample_counts():
    stats = ReadStats()
    jobs = list(read_tr(YAHOO, stats=stats))
    assert len(jobs) == 2910
    assert sum(len(j.tasks) for j in jobs) == 122_878
    assert stats.skipped == 0 and stats.jobs == 2910


def write_tr(tmp_path: Path) -> Path:
    path = tmp_path / "small.tr"
    path.write_text("0 2 1.5 1 2\n1.0 two 3 3\n2 1 4 4\n3 2 1 1\n")
    return path


def test_malformed_lines_are_skipped_and_counted_with_file_and_line(tmp_path):
    stats = ReadStats()
    jobs = list(read_tr(write_tr(tmp_path), stats=stats))
    assert [j.arrival_s for j in jobs] == [0.0, 2.0]
    assert stats.skipped == 2
    assert stats.problems[0].startswith("small.tr:2:")
    assert stats.problems[1].startswith("small.tr:4:") and "num_tasks is 2" in stats.problems[1]


def test_strict_stops_at_the_first_malformed_line(tmp_path):
    with pytest.raises(TraceError, match=r"^small\.tr:2:"):
        list(read_tr(write_tr(tmp_path), strict=True))


def test_gzipped_trace(tmp_path):
    path = tmp_path / "small.tr.gz"
    with gzip.open(path, "wt") as out:
        out.write("0 2 1.5 1 2\n")
    assert [j.durations_s for j in read_tr(path)] == [(1.0, 2.0)]
