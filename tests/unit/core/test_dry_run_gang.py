"""``dry_run_gang``: a gang job's dry run judges the gang whole, as the GM's ``Gangs``
would plan it, and books nothing on the view."""

from __future__ import annotations

from services.core.cluster_state import ClusterState
from services.core.dry_run import Outcome, dry_run_gang
from services.core.gang import Gang
from services.core.global_view import GlobalView
from services.core.limits import QueueLimits
from services.core.scheduler import Scheduler
from services.core.user_queues import UserQueues
from tests.builders import NODE, task


def scheduler(nodes: int = 2) -> tuple[Scheduler, ClusterState]:
    state = ClusterState("lm-0", ("gm-a",))
    for i in range(nodes):
        state.add_node(f"w{i}", NODE)
    sched = Scheduler(GlobalView("gm-a"), UserQueues(["q"]), None, QueueLimits.parse([]))
    sched.apply(state.snapshot(), 0.0)
    return sched, state


def gang(size: int, cpu: int, min_tasks: int = 0) -> Gang:
    members = tuple(task(f"t{i}", cpu=cpu, job_id="j") for i in range(size))
    return Gang("j/1", members, min_tasks)


def test_a_gang_is_placed_whole_or_waits_whole_and_nothing_is_booked():
    sched, state = scheduler()  # two nodes of NODE's cpu
    cpu = int(NODE[0]) * 3 // 4
    free = sched.view.lms["lm-0"].table.free.copy()
    outlooks = dry_run_gang(sched, "q", gang(2, cpu), 0.0)
    assert [o.outcome for o in outlooks] == [Outcome.PLACED, Outcome.PLACED]
    assert {o.node_id for o in outlooks} == {"w0", "w1"}
    assert (sched.view.lms["lm-0"].table.free == free).all()
    # Three never fit whole; with min_tasks 2, two start together and one waits.
    never = dry_run_gang(sched, "q", gang(3, cpu), 0.0)
    assert {o.outcome for o in never} == {Outcome.NEVER}
    assert never[0].reason.startswith("the gang can never start whole here")
    some = dry_run_gang(sched, "q", gang(3, cpu, min_tasks=2), 0.0)
    assert [o.outcome for o in some] == [Outcome.PLACED, Outcome.PLACED, Outcome.WAITS]
    assert "min_tasks" in some[2].reason
    # A node taken: the gang of two would fit the federation, not now: it waits whole.
    state.launch("gm-a", task("busy", cpu=cpu, job_id="other"), 0)
    sched.apply(state.snapshot(), 1.0)
    waits = dry_run_gang(sched, "q", gang(2, cpu), 1.0)
    assert {o.outcome for o in waits} == {Outcome.WAITS}
    assert waits[0].reason.startswith("the gang waits to start whole"), waits[0]


def test_a_member_that_could_never_run_makes_the_whole_gang_never():
    sched, _ = scheduler()
    members = (task("t0", cpu=1000, job_id="j"), task("t1", cpu=int(NODE[0]) * 2, job_id="j"))
    first, second = dry_run_gang(sched, "q", Gang("j/1", members), 0.0)
    assert first.outcome == second.outcome == Outcome.NEVER
    assert "task 1 can never run here" in first.reason and second.reason != first.reason
