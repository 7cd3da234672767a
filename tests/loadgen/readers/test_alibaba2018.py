"""Alibaba 2018 ``batch_task.csv``: one task per instance, jobs by job_name."""

import math

import pytest

from loadgen.readers.alibaba2018 import MEMORY_MB_PER_PERCENT, read_alibaba2018
from loadgen.trace import ReadStats, TraceError

ROWS = [
    # task_name,instance_num,job_name,task_type,status,start_time,end_time,plan_cpu,plan_mem
    "M1,3,j_2,1,Terminated,100,160,50,1.5",
    "R2_1,1,j_2,1,Failed,90,95,100,",
    "M1,2,j_1,1,Terminated,50,70,,0.2",
    "M3,4,j_1,1,Running,60,0,100,0.2",
    "M1,1,j_3,1,Waiting,,,100,0.2",
]


def check(jobs, stats):
    assert [j.job_id for j in jobs] == ["j_1", "j_2"]  # by arrival; j_3 never ran
    j1, j2 = jobs
    assert j1.arrival_s == 50 and j1.durations_s == (20.0, 20.0)
    assert j1.tasks[0].cpu_milli == 1000  # plan_cpu empty: the model's default core
    assert j2.arrival_s == 90  # the earliest start of its tasks
    assert sorted(j2.durations_s) == [5.0, 60.0, 60.0, 60.0]
    big = next(t for t in j2.tasks if t.duration_s == 60.0)
    assert big.cpu_milli == 500  # plan_cpu 100 = one core
    assert big.memory_mb == math.ceil(1.5 * MEMORY_MB_PER_PERCENT)
    assert stats.incomplete == 5  # 4 running instances + 1 waiting
    assert stats.skipped == 0


def test_headerless_published_layout(tmp_path):
    path = tmp_path / "batch_task.csv"
    path.write_text("\n".join(ROWS) + "\n")
    stats = ReadStats()
    check(list(read_alibaba2018(path, stats=stats)), stats)


def test_header_in_another_order(tmp_path):
    path = tmp_path / "batch_task.csv"
    header = (
        "job_name,task_name,instance_num,task_type,status,start_time,end_time,plan_cpu,plan_mem"
    )
    reordered = []
    for row in ROWS:
        f = row.split(",")
        reordered.append(",".join([f[2], f[0], f[1], *f[3:]]))
    path.write_text("\n".join([header, *reordered]) + "\n")
    stats = ReadStats()
    check(list(read_alibaba2018(path, stats=stats)), stats)


def test_malformed_rows_with_file_and_line(tmp_path):
    path = tmp_path / "batch_task.csv"
    bad = ["M1,2,j_9,1,Terminated,100,90,100,1", "M1,x,j_9,1,Terminated,1,2,100,1", "M1,1"]
    path.write_text("\n".join([ROWS[0], *bad]) + "\n")
    stats = ReadStats()
    jobs = list(read_alibaba2018(path, stats=stats))
    assert [j.job_id for j in jobs] == ["j_2"]
    assert stats.skipped == 3
    assert stats.problems[0] == "batch_task.csv:2: end_time 90 is before start_time 100"
    assert stats.problems[1].startswith("batch_task.csv:3: instance_num is not a number")
    assert stats.problems[2].startswith("batch_task.csv:4: no ")
    with pytest.raises(TraceError, match=r"^batch_task\.csv:2: end_time"):
        list(read_alibaba2018(path, strict=True))


def test_header_missing_a_needed_column(tmp_path):
    path = tmp_path / "batch_task.csv"
    path.write_text("task_name,instance_num,job_name,status,start_time\nM1,1,j,Terminated,1\n")
    with pytest.raises(TraceError, match=r"batch_task\.csv:1: header has no end_time"):
        list(read_alibaba2018(path))
