"""A dry run of one job: where each task would go now, or why not (``megha submit --dry-run``).

    tasks ──never_runs──▶ NEVER (refused at submission: no node could hold it, or its
      │                   queue's limit is smaller)
      ├──limit ledger──▶ WAITS (the queue's limit is reached)
      ├──match──▶ PLACED on lm/node (booked on the view for the job's later tasks)
      ├──Alg. 2──▶ PREEMPTS on lm/node (an under-share queue, victims found)
      └──assess──▶ WAITS, with the reason the task would be given in its queue

    a gang (``dry_run_gang``) ──Scheduler.plan_gang──▶ every member PLACED where the GM would
      reserve it now (with ``min_tasks``, the others WAITS: they start one by one after),
      or every member PREEMPTS (no room now; its queue would preempt for it whole:
      ``Scheduler.gang_evictions``, nothing pledged) or WAITS (no room for the whole
      gang now, or not within its queue's limit) or NEVER (it never fits, or asks more
      than the limit)

The same decisions a scheduling round makes (``Scheduler``: never_runs, the queue's
``LimitLedger``, ``GlobalView.match``, ``preemption_plan``, ``assess``), on the GM's own
view. Like Nomad's ``job plan`` it changes nothing: the room the job's earlier tasks would
take is booked on the view while the later ones are judged, then given back before
``dry_run`` returns, and the view's round-robin positions are put back. The caller must
not yield between the two (a GM runs it synchronously on its loop).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from services.core.gang import Eviction, Gang, gang_never_fits
from services.core.global_view import PreemptionPlan
from services.core.gpa import task_usage
from services.core.scheduler import WAITING_FOR_RESOURCES, RoundPlan, Scheduler
from services.core.status import Schedulability, Verdict
from services.core.task import TaskSpec


class Outcome(enum.IntEnum):
    """Values match ``megha.v1.PlanOutcome``."""

    PLACED = 1
    PREEMPTS = 2
    WAITS = 3
    NEVER = 4


@dataclass(frozen=True, slots=True)
class TaskOutlook:
    """What would happen to one task submitted now."""

    outcome: Outcome
    lm_id: str = ""
    node_id: str = ""
    repartition: bool = False  # the node is in another GM's partition
    reason: str = ""


def dry_run(
    scheduler: Scheduler, queue: str, specs: Sequence[TaskSpec], now: float | None
) -> list[TaskOutlook]:
    """Each task's outlook, in order, as if the job were submitted to ``queue`` now."""
    view = scheduler.view
    rr = (view._rr_internal, view._rr_external)
    # Not the GM's round (``_ledger`` may set a recheck on it): a scratch plan.
    ledger = scheduler._ledger(now, RoundPlan())
    booked: list[tuple[str, int, TaskSpec]] = []
    out: list[TaskOutlook] = []
    try:
        for spec in specs:
            out.append(_outlook(scheduler, queue, spec, now, ledger, booked))
    finally:
        for lm_id, node, spec in reversed(booked):
            mean, var = task_usage(spec)
            view.lms[lm_id].table.give_back(node, spec.resources, mean, var)
        view._rr_internal, view._rr_external = rr
    return out


def dry_run_gang(
    scheduler: Scheduler, queue: str, gang: Gang, now: float | None
) -> list[TaskOutlook]:
    """Each member's outlook, in order, as if the gang job were submitted to ``queue``
    now: the plan the GM's ``Gangs`` would reserve (``plan_gang``; nothing is booked),
    judged whole. A member that could never run alone makes the whole gang NEVER (its
    submission is refused), as does a gang no set of nodes could ever hold."""
    never = [scheduler.never_runs(queue, m, now) for m in gang.members]
    if any(why is not None for why in never):
        i, why = next((i, why) for i, why in enumerate(never) if why is not None)
        whole = f"its gang can never start whole: task {i} can never run here ({why})"
        return [TaskOutlook(Outcome.NEVER, reason=why or whole) for why in never]
    over = gang_never_fits(gang, queue, scheduler.limits)
    if over is not None:
        return [TaskOutlook(Outcome.NEVER, reason=f"its gang can never start: {over}")] * len(
            gang.members
        )
    outcome = scheduler.plan_gang(queue, gang, now, judge_never=True)
    if isinstance(outcome, Verdict):
        if outcome.schedulability is Schedulability.INFEASIBLE:
            verdict = TaskOutlook(
                Outcome.NEVER, reason=f"the gang can never start whole here: {outcome.reason}"
            )
        else:
            eviction = scheduler.gang_evictions(queue, gang, now, pledge=False)
            if isinstance(eviction, Eviction):
                verdict = TaskOutlook(
                    Outcome.PREEMPTS,
                    reason=f"the gang would preempt {len(eviction.victims)} task(s) of queue "
                    f"{eviction.queue} (over its share) and start whole in their room",
                )
            else:
                verdict = TaskOutlook(
                    Outcome.WAITS, reason=f"the gang waits to start whole: {outcome.reason}"
                )
        return [verdict] * len(gang.members)
    placed = {piece.task.task_id: piece for piece in outcome.pieces}
    later = TaskOutlook(
        Outcome.WAITS,
        reason=f"not among the {gang.needed} that start together (min_tasks): placed one "
        "by one once the gang started",
    )
    return [
        TaskOutlook(Outcome.PLACED, p.lm_id, p.node_id, p.repartition) if p is not None else later
        for p in (placed.get(m.task_id) for m in gang.members)
    ]


def _outlook(scheduler, queue, spec, now, ledger, booked) -> TaskOutlook:
    never = scheduler.never_runs(queue, spec, now)
    if never is not None:
        return TaskOutlook(Outcome.NEVER, reason=never)
    if ledger is not None and (why := ledger.check(queue, spec.resources)):
        return TaskOutlook(Outcome.WAITS, reason=why)
    view = scheduler.view
    placement = view.match(spec, now=now)
    if placement is not None:
        mean, var = task_usage(spec)
        view.lms[placement.lm_id].table.take(placement.node, spec.resources, mean, var)
        booked.append((placement.lm_id, placement.node, spec))
        if ledger is not None:
            ledger.take(queue, spec.resources)
        return TaskOutlook(
            Outcome.PLACED, placement.lm_id, placement.node_id, placement.repartition
        )
    room = view.assess(spec).reason or WAITING_FOR_RESOURCES
    fair = scheduler.fair
    if fair is None or len(fair.queues) < 2:
        return TaskOutlook(Outcome.WAITS, reason=room)
    plan = view.preemption_plan(spec, fair, scheduler.pledged, now=now)
    if isinstance(plan, PreemptionPlan):
        victims = plan.victims
        return TaskOutlook(
            Outcome.PREEMPTS,
            plan.lm_id,
            plan.node_id,
            reason=f"{room}; would preempt {len(victims.task_ids)} task(s) of queue "
            f"{victims.queue}, which is over its share",
        )
    return TaskOutlook(Outcome.WAITS, reason=f"{plan}; {room}")
