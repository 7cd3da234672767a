"""Google cluster-data 2019 ``instance_events``: the published column order, a header,
JSON lines; runs summed per instance; malformed rows reported with file and line."""

import json
from pathlib import Path

import pytest

from loadgen.readers.google2019 import AFTER_TRACE_END, read_google2019
from loadgen.trace import ReadStats, TraceError

S = 1_000_000  # microseconds per second
# (time, type, collection_id, collection_type, instance_index, cpus, memory)
EVENTS = [
    (5 * S, 0, "42", 0, 0, 0.5, 0.25),  # job 42, task 0: SUBMIT
    (6 * S, 3, "42", 0, 0, "", ""),  # SCHEDULE (no request on this row)
    (16 * S, 6, "42", 0, 0, "", ""),  # FINISH: ran 10 s
    (4 * S, 0, "42", 0, 1, 0.1, 0.0),  # task 1 submitted first: job arrives at 4 s
    (7 * S, 3, "42", 0, 1, "", ""),
    (9 * S, 4, "42", 0, 1, "", ""),  # EVICT after 2 s
    (20 * S, 3, "42", 0, 1, "", ""),
    (23 * S, 6, "42", 0, 1, "", ""),  # FINISH after 3 more: 5 s in all
    (8 * S, 0, "42", 0, 2, 0.1, 0.1),  # task 2 never scheduled: incomplete
    (1 * S, 0, "7", 0, 0, 0.0, 0.0),  # job 7 arrives first
    (2 * S, 3, "7", 0, 0, "", ""),
    (AFTER_TRACE_END, 6, "7", 0, 0, "", ""),  # still running at the end: incomplete
    (1 * S, 0, "8", 1, 0, 0.2, 0.2),  # an alloc set: ignored
    (2 * S, 3, "8", 1, 0, "", ""),
    (3 * S, 6, "8", 1, 0, "", ""),
]


def published_row(time, kind, job, ctype, index, cpus, memory):
    # time type collection_id scheduling_class missing_type collection_type priority
    # alloc_collection_id instance_index machine_id alloc_instance_index cpus memory constraint
    fields = [time, kind, job, 1, "", ctype, 200, 0, index, 99, -1, cpus, memory, "[]"]
    return ",".join(str(f) for f in fields)


def check_jobs(jobs, stats):
    assert [j.job_id for j in jobs] == ["42"]
    job = jobs[0]
    assert job.arrival_s == 4.0
    assert job.durations_s == (10.0, 5.0)
    assert (job.tasks[0].cpu_milli, job.tasks[0].memory_mb) == (32_000, 64 * 1024)
    assert (job.tasks[1].cpu_milli, job.tasks[1].memory_mb) == (6_400, 0)
    assert stats.incomplete == 2  # task 2 of job 42, and job 7's only task
    assert stats.skipped == 0


def test_headerless_published_column_order(tmp_path):
    path = tmp_path / "instance_events-000000000000.csv"
    path.write_text("\n".join(published_row(*e) for e in EVENTS) + "\n")
    stats = ReadStats()
    check_jobs(list(read_google2019(path, stats=stats)), stats)


def test_header_with_resource_request_as_one_cell(tmp_path):
    path = tmp_path / "events.csv"
    lines = ["type,time,instance_index,collection_id,collection_type,resource_request"]
    for time, kind, job, ctype, index, cpus, memory in EVENTS:
        request = json.dumps({"cpus": cpus, "memory": memory}) if cpus != "" else ""
        cell = '"' + request.replace('"', '""') + '"' if request else ""
        lines.append(f"{kind},{time},{index},{job},{ctype},{cell}")
    path.write_text("\n".join(lines) + "\n")
    stats = ReadStats()
    check_jobs(list(read_google2019(path, stats=stats)), stats)


def test_bigquery_json_lines(tmp_path):
    path = tmp_path / "instance_events-000000000000.json"
    rows = []
    for time, kind, job, ctype, index, cpus, memory in EVENTS:
        row = {"time": str(time), "type": str(kind), "collection_id": job}
        row |= {"collection_type": str(ctype), "instance_index": str(index)}
        if cpus != "":
            row["resource_request"] = {"cpus": cpus, "memory": memory}
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    stats = ReadStats()
    check_jobs(list(read_google2019(path, stats=stats)), stats)


def test_jobs_sorted_by_arrival_and_max_jobs(tmp_path):
    path = tmp_path / "events.csv"
    rows = []
    for job, submit in (("b", 30), ("a", 10), ("c", 20)):
        rows += [(submit * S, 0, job, 0, 0, 0.1, 0.1), ((submit + 1) * S, 3, job, 0, 0, "", "")]
        rows.append(((submit + 2) * S, 6, job, 0, 0, "", ""))
    path.write_text("\n".join(published_row(*r) for r in rows) + "\n")
    assert [j.job_id for j in read_google2019(path)] == ["a", "c", "b"]
    assert [j.job_id for j in read_google2019(path, max_jobs=2)] == ["a", "c"]


def write_malformed(tmp_path: Path) -> Path:
    path = tmp_path / "bad.csv"
    good = [published_row(*e) for e in EVENTS[:3]]
    bad_type = published_row(5 * S, 42, "42", 0, 3, 0.1, 0.1)
    bad_time = published_row("soon", 0, "42", 0, 3, 0.1, 0.1)
    path.write_text("\n".join([good[0], bad_type, good[1], bad_time, good[2], "1,2,3"]) + "\n")
    return path


def test_malformed_rows_skipped_and_counted(tmp_path):
    stats = ReadStats()
    jobs = list(read_google2019(write_malformed(tmp_path), stats=stats))
    assert [j.durations_s for j in jobs] == [(10.0,)]
    assert stats.skipped == 3
    assert stats.problems[0].startswith("bad.csv:2:") and "event type 42" in stats.problems[0]
    assert stats.problems[1].startswith("bad.csv:4:") and "time" in stats.problems[1]
    assert stats.problems[2].startswith("bad.csv:6:")


def test_strict_raises_on_the_first_malformed_row(tmp_path):
    with pytest.raises(TraceError, match=r"^bad\.csv:2: event type 42"):
        list(read_google2019(write_malformed(tmp_path), strict=True))


def test_header_without_required_columns(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("time,type,machine_id\n1,0,3\n")
    with pytest.raises(TraceError, match=r"events\.csv:1: header has no collection_id"):
        list(read_google2019(path))
