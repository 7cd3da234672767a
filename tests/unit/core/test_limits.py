import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.limits import (
    UNLIMITED,
    LimitLedger,
    QueueLimits,
    describe_held,
    format_limit,
    limit_from_wire,
    limit_to_wire,
    parse_limit,
)
from services.core.resources import CPU, MEMORY, ResourceError, resources


def test_a_limit_names_some_resources_and_leaves_the_others_unlimited():
    limit = parse_limit("cpu=4,mem=8Gi")
    assert limit[CPU] == 4000 and limit[MEMORY] == 8192
    assert (limit[2:] == UNLIMITED).all()
    assert format_limit(limit) == "cpu=4,mem=8192Mi"
    assert (parse_limit(format_limit(limit)) == limit).all()
    assert format_limit(parse_limit("cpu=1500m")) == "cpu=1500m"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu=0", "a limit must be above 0: cpu is 0"),
        ("mem=4Gi,cpu=0m", "cpu is 0"),
        ("foo=1", "unknown resource 'foo'"),
        ("cpu=1,cpu=2", "given twice"),
        ("", "no resources given"),
        ("mem=2000000Ti", "out of range: mem"),
    ],
)
def test_a_bad_limit_says_why(text, message):
    with pytest.raises(ResourceError, match=message):
        parse_limit(text)


def test_the_wire_form_shows_an_unlimited_resource_as_0():
    limit = parse_limit("mem=1Gi")
    wire = limit_to_wire(limit)
    assert wire.tolist() == [0, 1024, 0, 0]
    assert (limit_from_wire(wire) == limit).all()


def test_a_task_bigger_than_its_queue_limit_can_never_run():
    limits = QueueLimits.parse([("small", "cpu=2,mem=1Gi"), ("free", "")])
    assert "free" not in limits and "small" in limits
    assert limits.never_fits("free", resources(cpu_milli=10**6)) is None
    assert limits.never_fits("small", resources(cpu_milli=2000, memory_mb=1024)) is None
    why = limits.never_fits("small", resources(cpu_milli=2500, memory_mb=2048))
    assert (
        why
        == "it asks for more than queue 'small' may ever hold (cpu 2500m > 2, mem 2048Mi > 1024Mi)"
    )


def test_no_limit_anywhere_is_falsy():
    assert not QueueLimits.parse([("a", ""), ("b", "  ")])


def test_the_ledger_counts_what_the_round_places_on_top_of_the_view():
    limits = QueueLimits.parse([("q", "cpu=2")])
    ledger = LimitLedger(limits, {"q": resources(cpu_milli=1000), "other": resources(cpu_milli=9)})
    one = resources(cpu_milli=1000)
    assert ledger.check("q", one) is None
    ledger.take("q", one)
    why = ledger.check("q", one)
    assert why == (
        "queue 'q' is at its limit (cpu 2 of 2 held, needs 1); waiting for its tasks to end"
    )
    assert ledger.check("other", resources(cpu_milli=10**6)) is None  # not limited
    assert describe_held(ledger.held("q"), limits.get("q")) == "cpu 2/2"


def test_the_ledger_does_not_change_the_usage_it_was_given():
    usage = {"q": resources(cpu_milli=500)}
    ledger = LimitLedger(QueueLimits.parse([("q", "cpu=2")]), usage)
    ledger.take("q", resources(cpu_milli=500))
    assert usage["q"][CPU] == 500 and ledger.held("q")[CPU] == 1000


def test_a_queue_the_view_has_not_seen_holds_nothing():
    ledger = LimitLedger(QueueLimits.parse([("q", "mem=1Gi")]), {})
    assert ledger.check("q", resources(memory_mb=1024)) is None
    assert ledger.check("q", resources(memory_mb=1025)) is not None


def test_while_usage_is_unknown_every_limited_queue_waits():
    ledger = LimitLedger(QueueLimits.parse([("q", "cpu=8")]), {}, unknown="not heard from lm-2")
    assert ledger.check("q", resources(cpu_milli=1)) == "not heard from lm-2"
    assert ledger.check("unlimited", resources(cpu_milli=1)) is None


@given(
    limit_cpu=st.integers(1, 10_000),
    limit_mem=st.integers(1, 10_000),
    start=st.tuples(st.integers(0, 12_000), st.integers(0, 12_000)),
    requests=st.lists(st.tuples(st.integers(0, 3_000), st.integers(0, 3_000)), max_size=40),
)
def test_placing_only_what_the_ledger_allows_never_exceeds_the_limit(
    limit_cpu, limit_mem, start, requests
):
    """Whatever the queue held at the start (over the limit after a config change,
    say), a round that takes only what ``check`` lets through ends no higher than
    max(start, limit) in each resource, and refuses a request only if taking it would
    have gone over."""
    limits = QueueLimits.parse([("q", f"cpu={limit_cpu}m,mem={limit_mem}Mi")])
    ledger = LimitLedger(limits, {"q": resources(cpu_milli=start[0], memory_mb=start[1])})
    held = np.array([start[0], start[1]])
    for cpu, mem in requests:
        request = resources(cpu_milli=cpu, memory_mb=mem)
        over = held[0] + cpu > limit_cpu or held[1] + mem > limit_mem
        assert (ledger.check("q", request) is not None) == over
        if not over:
            ledger.take("q", request)
            held += (cpu, mem)
        assert (ledger.held("q")[:2] == held).all()
        assert held[0] <= max(start[0], limit_cpu) and held[1] <= max(start[1], limit_mem)
