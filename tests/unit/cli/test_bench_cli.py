import json

import pytest

from services.cli import main


def test_bench_match_json_lists_each_size(capsys):
    assert main(["bench", "match", "--nodes", "200,1000", "--samples", "200", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["nodes"] for r in rows] == [200, 1000]
    for row in rows:
        assert row["constraints"] == 21
        assert 0 < row["p50_us"] <= row["p99_us"]
        assert row["hit_rate"] > 0.5  # the synthetic partitions leave room for most tasks


def test_bench_match_table_and_bad_input(capsys):
    assert main(["bench", "match", "--nodes", "300", "--samples", "100"]) == 0
    out = capsys.readouterr().out
    assert "p50 us" in out and "300" in out
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "match", "--nodes", "300", "--constraints", "99"])
    assert "argument --constraints: must be >= 1 and <= 64, got 99" in capsys.readouterr().err


def test_bench_hops_times_each_transport_at_each_rate(capsys):
    assert main(["bench", "hops", "--rates", "0,500", "--count", "30", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["transport"], r["rate"]) for r in rows] == [
        (t, rate) for rate in (0.0, 500.0) for t in ("tcp", "unary", "stream")
    ]
    for row in rows:
        assert row["round_trips"] == 30
        assert 0 < row["rtt_p50_ms"] <= row["rtt_p99_ms"]
        assert row["client_cpu_us"] >= 0 and row["server_cpu_us"] >= 0
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "hops", "--count", "0"])
    assert "argument --count: must be > 0, got 0" in capsys.readouterr().err
