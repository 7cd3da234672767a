"""``megha predictor train`` and ``megha bench predict``."""

import json
import re

import pytest

from services.cli import build_parser, main
from services.predictor.lifetime_model import load_model


def test_predictor_still_serves_without_an_action():
    args = build_parser().parse_args(["predictor", "--config", "fed.yaml"])
    assert args.command == "predictor" and args.action is None and args.config == "fed.yaml"


def test_predictor_train_writes_a_loadable_model(tmp_path, capsys):
    out = tmp_path / "m.pkl"
    argv = ["predictor", "train", "--synthetic", "600", "--out", str(out), "--max-iter", "5"]
    assert main(argv) == 0
    assert re.search(
        r"lifetime model on 600 VMs \(\d+ uptime-augmented rows\)", capsys.readouterr().out
    )
    model = load_model(out)
    assert model.schema.names == [
        "category",
        "cores",
        "deployment_size",
        "memory_gb",
        "priority",
        "user",
    ]


def test_predictor_train_reads_an_azure_vmtable(tmp_path, capsys):
    rows = [
        f"vm{i},sub{i % 7},dep{i // 2},{300 * i},{300 * i + 600 * (1 + i % 11)},"
        f"50,10,40,Interactive,{2 ** (i % 4)},{4 * 2 ** (i % 3)}"
        for i in range(400)
    ]
    table = tmp_path / "vmtable.csv"
    table.write_text("\n".join(rows) + "\n")
    out = tmp_path / "m.pkl"
    argv = ["predictor", "train", "--trace", str(table), "--out", str(out), "--max-iter", "5"]
    assert main(argv) == 0
    assert "lifetime model on 400 VMs" in capsys.readouterr().out
    assert load_model(out).schema.names == [
        "category",
        "cores",
        "deployment_size",
        "memory_gb",
        "user",
    ]


def test_predictor_train_explains_bad_input(tmp_path, capsys):
    assert main(["predictor", "train", "--out", str(tmp_path / "m.pkl")]) == 2
    assert "needs --out MODEL and one of --trace FILE or --synthetic N" in capsys.readouterr().err
    missing = str(tmp_path / "missing.csv")
    assert main(["predictor", "train", "--trace", missing, "--out", str(tmp_path / "m")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_bench_predict_json(tiny_model_path, capsys):
    argv = ["bench", "predict", "--model", str(tiny_model_path), "--batch", "300"]
    assert main([*argv, "--rpcs", "50", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["inprocess_batch"] == 300 and result["sidecar_rpcs"] == 50
    assert result["inprocess_us_per_vm"] > 0 and result["inprocess_one_vm_us"] > 0
    assert 0 < result["sidecar_p50_ms"] <= result["sidecar_p99_ms"]
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "predict", "--model", str(tiny_model_path), "--batch", "0"])
    assert "argument --batch: must be > 0, got 0" in capsys.readouterr().err
