"""A started gang that lost a member starts again whole (issue 33): the GM's decision.

    a member's next attempt (lost, retried, preempted; off its user queue)
        + the others' standing on the LMs (``LookupTasks``: newest attempt, held?, how it ended)
        ──regather──▶ Regather:
            stop    members still running: killed on their LMs (``StopTasks``), each
                    ends LOST and its LM queues its next attempt once the kill took effect
            waiting members whose next attempt is on its way (killed, or lost too)
            ready   every member to restart has its next attempt here: one gang again
                    (``plan_gang`` + reserve/commit, all or nothing)

Model and assumptions:

- A gang's members are the task ids the GM wrote on each of them when it started them
  together (``Task.gang_task_ids``): the restart needs no memory of the GM's, only what
  the queue and the LMs hold, so a GM that died meanwhile is replaced by one that decides
  the same from the redelivered messages.
- Exactly once stays the LMs': a killed member's next attempt is queued by its LM only
  once the kill took effect (``Lifecycle.stopping``), a lost one's once its worker is
  gone, so a restart that waits for every member's next attempt never runs two attempts
  of a member at once, and each attempt is placed once (reserve/commit, by attempt).
- A member that already ended for good (SUCCEEDED, CANCELLED, REJECTED) is not run
  again: the gang restarts with the others. A member that FAILED for good (no retry
  left) ends its whole gang instead (``ends_gang``): a gang's work needs every member, so
  the GM serving its queue cancels the job (``gang_failed``), and its other members end
  CANCELLED wherever they run or wait.
- The LMs' word is needed whole: while an LM has not answered (or no LM knows a member,
  its ending forgotten), nothing is stopped on its word and nothing starts; the driver
  asks again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.core.states import REQUEUED, TaskState


@dataclass(frozen=True, slots=True)
class Standing:
    """What the LMs know of one member: its newest attempt, where, whether an LM still
    holds it, and (not held) the state it ended in (None: its ending is forgotten)."""

    attempt: int
    lm_id: str
    running: bool
    ended: TaskState | None = None


@dataclass(frozen=True, slots=True)
class Stop:
    """Kill ``attempt`` of ``task_id`` on ``lm_id``: the gang restarts without it."""

    task_id: str
    attempt: int
    lm_id: str


@dataclass(frozen=True, slots=True)
class Regather:
    """What to do with a gang that lost a member. ``ready``: the arrived next attempts
    to start as one gang, once nothing is to be stopped or waited for (``start``);
    ``launched``: arrived attempts an LM already holds (their message is done);
    ``reason``: why it waits, for ``megha job``."""

    stop: tuple[Stop, ...] = ()
    waiting: tuple[str, ...] = ()
    ready: tuple[str, ...] = ()
    launched: tuple[str, ...] = ()
    reason: str = ""

    @property
    def start(self) -> bool:
        return bool(self.ready) and not self.stop and not self.waiting


def regather(
    members: Sequence[str],
    arrived: Mapping[str, int],
    standing: Mapping[str, Standing],
    complete: bool = True,
    lost: str = "",
) -> Regather:
    """Decide a gang's restart from the next attempts here (``arrived``: task id ->
    attempt) and what the LMs know (``standing``; ``complete``: every LM answered).
    ``lost`` names the member the kills' reason gives (default: the first arrived)."""
    lost = lost or next(iter(sorted(arrived)), "")
    stop: list[Stop] = []
    waiting: list[str] = []
    ready: list[str] = []
    launched: list[str] = []
    for task_id in sorted(set(members) | set(arrived)):
        known = standing.get(task_id)
        attempt = arrived.get(task_id)
        if attempt is not None:
            if known is None or (known.attempt < attempt and not known.running):
                ready.append(task_id)  # no LM has launched this attempt: to start
                continue
            if known.attempt >= attempt:
                launched.append(task_id)  # an earlier GM's commit: judged as the LMs know it
            # else an older attempt still runs (no LM queues the next attempt before the
            # older ended: this is defence): it is stopped first, the next waits here
        if known is None:
            waiting.append(task_id)  # an LM away, or its ending forgotten
        elif known.running:
            if complete:
                stop.append(Stop(task_id, known.attempt, known.lm_id))
            else:
                waiting.append(task_id)
        elif known.ended is None or known.ended in REQUEUED:
            waiting.append(task_id)  # its next attempt is on its way to the queue
        # else: ended for good, not run again
    if not complete and not waiting:
        waiting.append("")  # an LM's word is missing: nothing starts on a guess
    reason = ""
    if stop:
        reason = f"its gang restarts (member {lost} was lost): stopping {len(stop)} member(s)"
    elif waiting:
        named = [t for t in waiting if t]
        reason = f"its gang restarts (member {lost} was lost): waiting for " + (
            f"{len(named)} member(s) to stop" if named else "every LM to answer"
        )
    return Regather(tuple(stop), tuple(waiting), tuple(ready), tuple(launched), reason)


def kill_reason(lost: str) -> str:
    """The reason a member stopped for its gang's restart ends LOST with."""
    return f"gang member {lost} lost: its gang restarts whole"


def ends_gang(state: TaskState) -> bool:
    """Whether a started gang's member ending in ``state`` ends the whole gang: FAILED
    for good (a failure with a retry left ends RETRYING and restarts the gang whole)."""
    return state is TaskState.FAILED


def gang_failed(task_id: str, reason: str) -> str:
    """The reason the job of a gang whose member ``task_id`` FAILED is cancelled with."""
    return f"gang member {task_id} failed ({reason or 'no reason given'}): its gang is cancelled"
