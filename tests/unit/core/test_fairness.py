import numpy as np
import pytest

from services.core.fairness import FairShare, QueueShare, dominant_share, pick_victims
from services.core.node_table import NodeTable
from services.core.resources import resources
from services.core.snapshot import Allocation
from tests.builders import NODE, set_free_at, task

TOTAL = resources(10_000, 10_000)


def alloc(task_id, node, cpu, mem=0, seq=0, queue="hog"):
    return Allocation(task_id, queue, node, resources(cpu, mem), 0, False, seq)


def test_dominant_share_is_the_larger_of_cpu_and_memory():
    assert dominant_share(resources(1000, 5000), TOTAL) == 0.5
    assert dominant_share(resources(3000, 0), TOTAL) == 0.3
    assert dominant_share(resources(3000, 0), resources(0, 0)) == 0.0


def test_shares_are_validated():
    with pytest.raises(ValueError, match=r"add up to 1\.20"):
        FairShare([QueueShare("a", 0.6), QueueShare("b", 0.6)])
    with pytest.raises(ValueError, match="share must be in"):
        FairShare([QueueShare("a", 0.0)])
    with pytest.raises(ValueError, match="unique"):
        FairShare([QueueShare("a", 0.1), QueueShare("a", 0.1)])


def test_under_over_and_most_violating_queue():
    fair = FairShare([QueueShare("q1", 0.1), QueueShare("q2", 0.25), QueueShare("q4", 0.5)])
    usage = {"q1": resources(3000, 0), "q2": resources(0, 3200), "q4": resources(1000, 0)}
    assert fair.is_over_share("q1", usage, TOTAL) and fair.is_over_share("q2", usage, TOTAL)
    assert fair.is_under_share("q4", usage, TOTAL)
    assert fair.is_under_share("q3-unused", usage, TOTAL) is False  # no share at all
    assert fair.most_over_share(usage, TOTAL) == "q1"  # 0.20 over beats 0.07 over
    assert fair.most_over_share(usage, TOTAL, exclude="q1") == "q2"
    assert fair.describe("q2", usage, TOTAL) == "over share (32% of 25%)"
    assert fair.most_over_share({"q4": resources(1000, 0)}, TOTAL) is None


def test_pick_victims_needs_fewest_and_takes_youngest_first():
    table = NodeTable(1)
    for i in range(3):
        table.add(f"n{i}", NODE, 0, 0)
    set_free_at(table, np.s_[0, :], 0)
    running = [
        alloc("a-old", 0, 1000, seq=1),
        alloc("a-young", 0, 1000, seq=5),
        alloc("b-small", 1, 500, seq=2),
        alloc("b-big", 1, 3000, seq=3),
    ]
    victims = pick_victims(table, task(cpu=2000, mem=0 + 1), running)
    assert victims.node == 1 and victims.task_ids == ("b-big",)
    victims = pick_victims(table, task(cpu=1000, mem=1), running)
    assert victims.node == 0 and victims.task_ids == ("a-young",)
    # a node that lacks the task's constraints is never chosen
    assert pick_victims(table, task(cpu=1000, constraints=(2,)), running) is None
    assert pick_victims(table, task(cpu=9000), running) is None
    assert pick_victims(table, task(), []) is None


def test_pick_victims_agrees_with_brute_force(rng):
    table = NodeTable(1)
    nodes = 12
    for i in range(nodes):
        table.add(f"n{i}", NODE, 0, 0)
    for trial in range(100):
        set_free_at(table, np.s_[0], rng.integers(0, 1500, nodes))
        set_free_at(table, np.s_[1], 8192)
        running = [
            alloc(f"v{k}", int(rng.integers(0, nodes)), int(rng.integers(1, 1500)), seq=k)
            for k in range(int(rng.integers(1, 30)))
        ]
        need = int(rng.integers(1, 4000))
        got = pick_victims(table, task(f"x{trial}", cpu=need, mem=1), running)
        best = None
        for n in range(nodes):
            mine = sorted((a for a in running if a.node == n), key=lambda a: -a.sequence)
            free = int(table.free[0, n])
            for count, a in enumerate(mine, start=1):  # a preemption names >= 1 victim
                free += int(a.resources[0])
                if free >= need:
                    if best is None or count < best:
                        best = count
                    break
        if best is None:
            assert got is None
        else:
            assert got is not None and len(got.task_ids) == best
            freed = sum(int(a.resources[0]) for a in running if a.task_id in got.task_ids)
            assert int(table.free[0, got.node]) + freed >= need


def test_a_queue_preempts_only_below_its_share_less_the_slack():
    fair = FairShare([QueueShare("q1", 0.5), QueueShare("q2", 0.5)], slack=0.05)
    cpu = int(TOTAL[0])
    usage = {"q1": resources(cpu * 46 // 100, 0), "q2": resources(cpu * 54 // 100, 0)}
    assert fair.is_under_share("q1", usage, TOTAL)
    assert not fair.may_preempt("q1", usage, TOTAL)  # 4 pp under: within the slack
    assert "no more than the preemption slack" in fair.describe("q1", usage, TOTAL)
    usage["q1"] = resources(cpu * 44 // 100, 0)
    assert fair.may_preempt("q1", usage, TOTAL)
    assert FairShare([QueueShare("q1", 0.5)]).may_preempt("q1", usage, TOTAL)
    with pytest.raises(ValueError, match="slack"):
        FairShare([QueueShare("q1", 0.5)], slack=1.0)
