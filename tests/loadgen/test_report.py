"""The report files every measuring command writes (DESIGN.md §5) and the eq. 1-2 maths."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest

from loadgen import report

# DESIGN.md §5, copied by hand: a rename in report.py must fail here.
DESIGN_KEYS = [
    "target",
    "scheduler",
    "workers",
    "gms",
    "lms",
    "jobs",
    "tasks",
    "completed",
    "alloc_s",
    "components_s",
    "inconsistencies",
    "repartitions",
    "preemption_attempts",
    "preemptions",
    "throughput_tasks_per_s",
    "wall_s",
]
DESIGN_ALLOC = ["p50", "p90", "p99", "p999", "max"]
DESIGN_COMPONENTS = ["framework_queuing", "processing", "communication", "worker_queuing"]
DESIGN_MD = Path(__file__).resolve().parents[3] / "shared" / "DESIGN.md"

MS = 1_000_000  # nanoseconds


def stamps(**ms: float) -> dict[str, int]:
    """Stamps given in milliseconds after an arbitrary epoch."""
    base = 1_700_000_000_000_000_000
    out = dict.fromkeys(report.STAMPS, 0)
    out.update({name: base + int(value * MS) for name, value in ms.items()})
    return out


FULL = stamps(
    submitted=0,
    queued=1,
    dequeued=3,
    decided=3.5,
    lm_received=4.5,
    lm_decided=5,
    worker_received=6,
    started=6.25,
    finished=56,
)


def summary(target: str = "live", **extra):
    return report.make_summary(
        target=target,
        scheduler="megha",
        workers=300,
        gms=2,
        lms=3,
        jobs=10,
        tasks=10,
        completed=10,
        alloc_s=report.percentiles([0.001, 0.002]),
        components_s=report.component_medians([FULL]),
        **extra,
    )


def test_percentiles_of_known_values() -> None:
    p = report.percentiles(range(1, 1001))
    assert list(p) == DESIGN_ALLOC
    assert p["p50"] == pytest.approx(500.5)
    assert p["p90"] == pytest.approx(900.1)
    assert p["p99"] == pytest.approx(990.01)
    assert p["p999"] == pytest.approx(999.001)
    assert p["max"] == 1000


def test_percentiles_of_nothing_are_unknown_not_zero() -> None:
    assert report.percentiles([]) == dict.fromkeys(DESIGN_ALLOC)


def test_allocation_time_is_submission_to_start() -> None:
    assert report.allocation_s(FULL) == pytest.approx(0.00625)
    assert report.allocation_s({**FULL, "started": 0}) is None


def test_components_follow_paper_eq_2() -> None:
    parts = report.components_s(FULL)
    assert parts == pytest.approx(
        {
            "framework_queuing": 0.003,
            "processing": 0.0005,
            "communication": 0.001 + 0.001,
            "worker_queuing": 0.00025,
        }
    )
    # Together with the LM's own validation step they add up to the allocation time.
    lm_processing = report.detail_s(FULL)["lm_processing"]
    assert sum(parts.values()) + lm_processing == pytest.approx(report.allocation_s(FULL))
    assert report.components_s({**FULL, "lm_received": 0}) is None


def test_detail_steps_cover_submission_to_start_without_gaps() -> None:
    steps = report.detail_s(FULL)
    assert list(steps) == [name for name, _, _ in report.DETAIL_STEPS]
    assert sum(steps.values()) == pytest.approx(report.allocation_s(FULL))


def test_component_medians_skip_tasks_without_every_stamp() -> None:
    slow = {**FULL, "dequeued": FULL["submitted"] + 9 * MS}  # framework queuing 9 ms
    medians = report.component_medians([FULL, slow, {**FULL, "decided": 0}])
    assert medians["framework_queuing"] == pytest.approx(0.006)
    assert report.component_medians([]) == dict.fromkeys(DESIGN_COMPONENTS)


def test_summary_has_exactly_the_design_keys_then_the_extras() -> None:
    s = summary(offered_rate=200.0, duplicates=0)
    assert list(s) == [*DESIGN_KEYS, "offered_rate", "duplicates"]
    assert list(s["alloc_s"]) == DESIGN_ALLOC
    assert list(s["components_s"]) == DESIGN_COMPONENTS


def test_summary_keys_match_the_design_document() -> None:
    if not DESIGN_MD.exists():
        pytest.skip(f"{DESIGN_MD} is not beside the repository")
    block = re.search(r"```json\n(.*?)```", DESIGN_MD.read_text(), re.S)
    assert block is not None
    example = json.loads(block.group(1))
    assert list(example) == DESIGN_KEYS
    assert list(example["alloc_s"]) == DESIGN_ALLOC
    assert list(example["components_s"]) == DESIGN_COMPONENTS


def test_summary_refuses_an_unknown_target() -> None:
    with pytest.raises(ValueError, match="simulation"):
        summary(target="simulation")


def test_write_summary_round_trips_and_writes_unknowns_as_null(tmp_path: Path) -> None:
    s = report.make_summary(
        target="sim",
        scheduler="megha",
        workers=1,
        gms=1,
        lms=1,
        jobs=0,
        tasks=0,
        completed=0,
        alloc_s=report.percentiles([]),
        components_s={"processing": float("nan")},
    )
    path = report.write_summary(tmp_path / "out", s)
    assert path == tmp_path / "out" / "summary.json"
    loaded = json.loads(path.read_text())
    assert loaded == s
    assert loaded["alloc_s"]["p50"] is None
    assert loaded["components_s"]["processing"] is None


def test_write_summary_rejects_a_summary_without_design_keys(tmp_path: Path) -> None:
    s = summary()
    del s["wall_s"]
    del s["components_s"]["processing"]
    with pytest.raises(ValueError, match=r"wall_s.*components_s\.processing"):
        report.write_summary(tmp_path, s)
    assert not (tmp_path / "summary.json").exists()


def test_tasks_csv_has_the_contract_columns_first(tmp_path: Path) -> None:
    row = {
        "task_id": "j1.0",
        "job_id": "j1",
        "gm": "gm-1",
        "lm_id": "lm-2",
        "node_id": "lm-2-w7",
        **{f"{name}_unix_nanos": value for name, value in FULL.items()},
        "alloc_s": 0.00625,
        "unknown_key": "ignored",
    }
    path = report.write_tasks_csv(tmp_path, [row, {"task_id": "j2.0", "alloc_s": None}])
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    header = list(rows[0])
    assert header[:14] == [
        "task_id",
        "job_id",
        "gm",
        "lm_id",
        "node_id",
        "submitted_unix_nanos",
        "dequeued_unix_nanos",
        "decided_unix_nanos",
        "lm_received_unix_nanos",
        "lm_decided_unix_nanos",
        "worker_received_unix_nanos",
        "started_unix_nanos",
        "finished_unix_nanos",
        "alloc_s",
    ]
    assert "unknown_key" not in header
    assert int(rows[0]["started_unix_nanos"]) == FULL["started"]
    assert float(rows[0]["alloc_s"]) == pytest.approx(0.00625)
    assert rows[1]["alloc_s"] == "" and rows[1]["node_id"] == ""


def test_cdf_plot_is_written_when_matplotlib_is_installed(tmp_path: Path) -> None:
    path = report.write_cdf_png(tmp_path, [0.001, 0.002, 0.004])
    if importlib.util.find_spec("matplotlib") is None:
        assert path is None
    else:
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.write_cdf_png(tmp_path / "empty", []) is None


def test_render_summary_shows_milliseconds_and_unknowns() -> None:
    s = summary(offered_rate=200.0, duplicates=0)
    s["alloc_s"]["p999"] = None
    text = report.render_summary(s)
    assert "p50 1.50" in text and "p999 -" in text
    assert "completed / offered    10 / 10" in text
