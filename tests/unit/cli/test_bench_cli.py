import json

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
    assert main(["bench", "match", "--nodes", "300", "--constraints", "99"]) == 2
    assert "--constraints must be in 1..64" in capsys.readouterr().err
