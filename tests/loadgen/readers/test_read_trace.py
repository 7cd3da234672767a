"""``read_trace`` picks the reader; ``add_trace_arguments`` / ``jobs_from_args`` turn the
shared flags into augmented jobs."""

import argparse
import gzip

import numpy as np
import pytest

from loadgen.augment import satisfiable
from loadgen.readers import (
    add_trace_arguments,
    guess_format,
    jobs_from_args,
    machines_from_args,
    read_trace,
)
from loadgen.trace import ReadStats, TraceError

TR = "0 3 2 1 2 3\n5 2 4 4 4\n9 40 1 " + " ".join(["1"] * 40) + "\n"


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("yahoo.tr", "tr"),
        ("YH.tr.gz", "tr"),
        ("instance_events-000000000123.json.gz", "google2019"),
        ("batch_task.csv", "alibaba2018"),
        ("vmtable.csv.gz", "azure"),
    ],
)
def test_format_from_the_file_name(name, fmt):
    assert guess_format(name) == fmt


def test_unknown_name_asks_for_format(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("vm1,sub,dep,0,10,1,1,1,Unknown,2,4\n")
    with pytest.raises(TraceError, match="pass --format"):
        read_trace(path)
    assert [j.job_id for j in read_trace(path, fmt="azure")] == ["dep"]
    with pytest.raises(TraceError, match="unknown trace format 'parquet'"):
        read_trace(path, fmt="parquet")


def test_read_trace_passes_strict_max_jobs_and_stats(tmp_path):
    path = tmp_path / "vmtable.csv.gz"
    with gzip.open(path, "wt") as out:
        out.write("vm1,s,d1,0,10,1,1,1,U,2,4\nvm2,s,d2,5,1,1,1,1,U,2,4\nvm3,s,d3,7,9,1,1,1,U,2,4\n")
    stats = ReadStats()
    assert [j.job_id for j in read_trace(path, max_jobs=1, stats=stats)] == ["d1"]
    assert stats.skipped == 1 and stats.problems[0].startswith("vmtable.csv.gz:2:")
    with pytest.raises(TraceError, match=r"vmtable\.csv\.gz:2:"):
        list(read_trace(path, strict=True))


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    add_trace_arguments(parser)
    return parser.parse_args(argv)


def test_plain_flags_read_the_trace_unchanged(tmp_path):
    path = tmp_path / "small.tr"
    path.write_text(TR)
    jobs, stats = jobs_from_args(parse([str(path), "--max-jobs", "2"]))
    assert [len(j.tasks) for j in jobs] == [3, 2]
    assert all(t.cpu_milli == 1000 and t.constraints == () for j in jobs for t in j.tasks)
    assert stats.jobs == 2 and stats.notes == []
    assert machines_from_args(parse([str(path)])) is None


def test_every_augmentation_flag(tmp_path):
    path = tmp_path / "small.tr"
    path.write_text(TR)
    argv = [str(path), "--cores-per-task", "2", "--gridiron", "--cpu-scale", "400"]
    argv += ["--mem-scale", "50", "--constraints", "sharma-C", "--seed", "7"]
    args = parse(argv)
    jobs, stats = jobs_from_args(args)
    tasks = [t for j in jobs for t in j.tasks]
    assert {t.cpu_milli for t in tasks} == {5}  # 2 cores = 2000 milli, / 400
    # Gridiron ran on the real 2 cores: 200 Mbit/s per vlink, capped at 177.
    assert [t.net_mbps for t in jobs[0].tasks] == [2 * 177] * 3
    assert [t.net_mbps for t in jobs[2].tasks] == [29 * 177] * 30 + [9 * 177] * 10
    assert any(t.constraints for t in tasks)
    machines = machines_from_args(args)
    assert len(machines) == 10_000
    masks = np.array([sum(1 << c for c in t.constraints) for t in tasks], dtype=np.uint64)
    assert satisfiable(masks, machines).all()
    assert any(n.startswith("gridiron:") for n in stats.notes)
    assert any(n.startswith("constraints:") for n in stats.notes)
    again, _ = jobs_from_args(parse(argv))
    assert again == jobs


def test_bpc_implies_gridiron_and_workers_size_the_machines(tmp_path):
    path = tmp_path / "small.tr"
    path.write_text(TR)
    args = parse([str(path), "--bpc", "10", "--constraints", "sharma-B"])
    args.workers = 64  # as the simulate command would have it
    jobs, _ = jobs_from_args(args)
    assert [t.net_mbps for t in jobs[1].tasks] == [10, 10]
    assert len(machines_from_args(args)) == 64


@pytest.mark.parametrize(
    "argv",
    [["--peak-vdc", "1"], ["--cpu-scale", "0"], ["--max-jobs", "0"], ["--constraints", "x"]],
)
def test_bad_flag_values_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        parse(["t.tr", *argv])
