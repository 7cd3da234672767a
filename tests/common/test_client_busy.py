"""A GM whose intake is full refuses RESOURCE_EXHAUSTED with a retry hint: the client
waits as asked, a bounded number of times."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import grpc
import pytest

from services.common import client as client_module
from services.common.client import BUSY_PAUSE_MAX_S, GlobalMasterClient, busy_pauses, jittered
from services.common.request_stream import NotSent, rpc_error
from services.core.throttle import MIN_REQUESTS


def test_the_pauses_double_from_the_hint_and_are_capped() -> None:
    assert busy_pauses(8) == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert max(busy_pauses(20)) == BUSY_PAUSE_MAX_S and busy_pauses(0) == []


@pytest.fixture
async def gm(monkeypatch):
    """A client whose GM answers from ``answers`` (an error or a reply, in turn); the
    pauses it slept are in ``slept``."""
    target = GlobalMasterClient("127.0.0.1:1")
    target.answers, target.slept, target.sent = [], [], []
    clock = [1000.0]  # the client's monotonic clock: moved by its sleeps only

    async def submit_once(request):
        target.sent.append([t.timestamps.submitted_unix_nanos for t in request.tasks])
        answer = target.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def sleep(pause):
        target.slept.append(pause)
        clock[0] += pause

    monkeypatch.setattr(target, "_submit_once", submit_once)
    # The client module's asyncio only (its sole use is sleeping), not the test's loop's.
    monkeypatch.setattr(client_module, "asyncio", SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(
        client_module,
        "time",
        SimpleNamespace(
            monotonic=lambda: clock[0], perf_counter=time.perf_counter, time_ns=time.time_ns
        ),
    )
    yield target
    await target.close()


BUSY = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "retry it in a moment")


async def test_a_busy_gm_is_asked_again_after_the_pauses_it_asks_for(gm) -> None:
    gm.answers = [BUSY, BUSY, "queued"]
    heard = []
    assert await gm.submit([], busy_tries=8, on_busy=heard.append) == "queued"
    assert gm.slept == heard
    assert 0.05 <= heard[0] < 0.15 and 0.1 <= heard[1] < 0.3  # jittered, ``jittered``


async def test_the_retries_are_bounded_and_other_errors_are_not_retried(gm) -> None:
    gm.answers = [BUSY] * 4
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gm.submit([], busy_tries=3)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(gm.slept) == 3 and not gm.answers
    # A timeout may have queued the job: retrying it is the caller's choice, not this one's.
    gm.answers, gm.slept = [rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), "x"], []
    with pytest.raises(grpc.aio.AioRpcError):
        await gm.submit([], busy_tries=3)
    assert gm.slept == []
    gm.answers = [BUSY]  # without busy_tries, as before: the refusal at once
    with pytest.raises(grpc.aio.AioRpcError):
        await gm.submit([])


async def test_megha_submit_waits_for_a_busy_gm_and_says_so(gm, capsys) -> None:
    from services.app import operator
    from services.common.client import TaskTemplate
    from services.core.resources import resources

    gm.answers = [BUSY, SimpleNamespace(job_id="j1", task_ids=["j1.0"])]
    args = SimpleNamespace(dry_run=False, json=False, wait=False)
    template = TaskTemplate(resources=resources(1000, 64))
    assert await operator._queue_job(gm, args, None, [template], "", "", "1 sim") == 0
    out, err = capsys.readouterr()
    assert "job j1: 1 tasks queued" in out
    assert "the GM is busy; trying again in 0.1 s" in err and 0.05 <= gm.slept[0] < 0.15


async def test_each_try_says_how_long_it_waited_for_its_answer(gm) -> None:
    gm.answers = [BUSY, BUSY, "queued"]
    waited: list[float] = []
    assert await gm.submit([], busy_tries=8, on_answer=waited.append) == "queued"
    assert len(waited) == 3 and all(0 <= took < 1 for took in waited)
    gm.answers = [rpc_error(grpc.StatusCode.INTERNAL, "broken")]
    with pytest.raises(grpc.aio.AioRpcError):
        await gm.submit([], busy_tries=8, on_answer=waited.append)
    assert len(waited) == 4  # an error is an answer too


async def test_a_try_not_sent_in_time_is_waited_out_and_no_answer(gm) -> None:
    """A streamed try the client did not send within ``SEND_WITHIN_S`` (``NotSent``):
    no try the GM answered, so not counted as one, nor as one of its refusals; the job
    asks again after a pause."""
    gm.answers = [NotSent("submit", 0.5), NotSent("submit", 0.5), "queued"]
    waited: list[float] = []
    assert await gm.submit([], busy_tries=1, on_answer=waited.append) == "queued"
    assert gm.unsent == 2 and len(gm.slept) == 2 and len(waited) == 1
    gm.answers = [NotSent("submit", 0.5)]  # without busy tries: at once, as a refusal
    with pytest.raises(NotSent):
        await gm.submit([])


async def test_each_try_stamps_its_own_time_on_copies_of_the_tasks(gm) -> None:
    from services._proto.megha.v1 import common_pb2

    given = [common_pb2.Task(task_id="a"), common_pb2.Task(task_id="b")]
    given[1].timestamps.submitted_unix_nanos = 7  # the caller's own stamp is kept
    gm.answers = [BUSY, BUSY, "queued"]
    assert await gm.submit(given, busy_tries=8) == "queued"
    (first, keep1), (second, keep2), (third, keep3) = gm.sent
    assert keep1 == keep2 == keep3 == 7
    assert 0 < first < second < third  # each try's time, not the first one's
    assert not given[0].timestamps.submitted_unix_nanos  # the caller's task is unchanged


def test_a_pause_is_jittered_within_half_of_itself_either_way() -> None:
    rng = random.Random(7)
    pauses = [jittered(1.0, rng) for _ in range(1000)]
    assert min(pauses) >= 0.5 and max(pauses) < 1.5
    assert max(pauses) - min(pauses) > 0.9  # spread, not one value


async def test_a_client_the_gm_keeps_refusing_holds_tries_back(gm, monkeypatch) -> None:
    """Client-side throttling (``AdaptiveThrottle``): past a few refusals most tries are
    kept back, answered at once without a message; a kept-back try is no try, so the
    job still goes once the GM takes it."""
    monkeypatch.setattr(client_module, "_JITTER", random.Random(3))
    gm.answers = [BUSY] * (MIN_REQUESTS - 1)
    for _ in range(MIN_REQUESTS - 1):  # jobs of one try each: the GM refused every one
        with pytest.raises(grpc.aio.AioRpcError):
            await gm.submit([])
    assert gm.throttled == 0 and not gm.answers  # a few tries are never held back
    gm.answers = [BUSY, BUSY, "queued"]
    heard: list[float] = []
    assert await gm.submit([], busy_tries=8, on_busy=heard.append) == "queued"
    assert not gm.answers and len(gm.sent) == MIN_REQUESTS - 1 + 3  # kept back: unsent
    assert gm.throttled > 0 and len(heard) == 2 + gm.throttled  # a pause after each
    # The pauses back off over every try, sent or kept back, up to the hint's cap.
    bases = busy_pauses(8)
    for step, pause in enumerate(heard):
        assert 0.5 <= pause / bases[min(step, 7)] < 1.5


async def test_a_kept_back_job_gives_up_after_its_pauses_would_have_passed(gm) -> None:
    gm.answers = [BUSY] * 1_000
    for _ in range(50):
        with pytest.raises(grpc.aio.AioRpcError):
            await gm.submit([])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gm.submit([], busy_tries=3)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gm.throttled > 0 and len(gm.sent) <= 50 + 4  # most tries kept back
    assert sum(gm.slept) >= sum(busy_pauses(3)) * 0.5  # it waited about as long as asked


async def test_unreachable_gms_and_timeouts_do_not_count_against_it(gm) -> None:
    gone = rpc_error(grpc.StatusCode.UNAVAILABLE, "down")
    gm.answers = [gone] * 100
    for _ in range(100):
        with pytest.raises(grpc.aio.AioRpcError):
            await gm.submit([], busy_tries=8)
    assert gm.throttle.counts(1000.0) == (0, 0) and gm.throttled == 0  # the clock did not move


UNSURE = rpc_error(grpc.StatusCode.UNAVAILABLE, "the broker did not confirm job j: retry it")


async def test_an_unsure_answer_is_asked_again_under_one_job_id_for_a_while(gm) -> None:
    ids: list[str] = []

    async def submit_once(request):
        ids.append(request.job_id)
        answer = gm.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    gm._submit_once = submit_once
    late = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "no submit reply in 30 s")
    gm.answers = [UNSURE, late, "queued"]
    heard = []
    assert await gm.submit([], unsure_for_s=30, on_unsure=lambda *a: heard.append(a)) == "queued"
    assert len(set(ids)) == 1 and len(ids[0]) == 12  # one id, made here, kept by every try
    assert [(err.code(), job) for err, job, _ in heard] == [
        (grpc.StatusCode.UNAVAILABLE, ids[0]),
        (grpc.StatusCode.DEADLINE_EXCEEDED, ids[0]),
    ]
    assert [p for *_, p in heard] == gm.slept and 0.05 <= gm.slept[0] < 0.15
    # The caller's own id is kept; the tries stop once the next pause would pass the bound.
    ids.clear()
    gm.answers, gm.slept = [UNSURE] * 20, []
    with pytest.raises(grpc.aio.AioRpcError):
        await gm.submit([], job_id="mine", unsure_for_s=3)
    assert set(ids) == {"mine"} and sum(gm.slept) <= 3 and len(gm.slept) >= 3
    # A GM none could connect to is not one that may have queued it: said at once.
    gm.answers, gm.slept = [rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect")], []
    with pytest.raises(grpc.aio.AioRpcError):
        await gm.submit([], unsure_for_s=30)
    assert gm.slept == []


def test_megha_submit_retries_for_as_long_as_the_client_says() -> None:
    from services import cli

    assert cli._OUTAGE_S == client_module.OUTAGE_S
    args = cli.build_parser().parse_args(["submit"])
    assert args.retry_for == client_module.OUTAGE_S
    assert cli.build_parser().parse_args(["submit", "--retry-for", "0"]).retry_for == 0
