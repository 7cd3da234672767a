from services.core.user_queues import UserQueues


def test_round_robin_rotates_the_first_queue():
    q = UserQueues(["a", "b"])
    for i in range(3):
        q.push("a", f"a{i}")
        q.push("b", f"b{i}")
    assert q.pop_round(1) == [("a", "a0"), ("b", "b0")]
    assert q.pop_round(1) == [("b", "b1"), ("a", "a1")]
    assert q.pop_round(5) == [("a", "a2"), ("b", "b2")]
    assert q.pop_round(5) == [] and len(q) == 0


def test_parked_items_wait_then_go_first_in_order():
    q = UserQueues(["a"])
    q.push("a", 1)
    q.push("a", 2)
    assert q.pop_round(2) == [("a", 1), ("a", 2)]
    q.park("a", 1)
    q.park("a", 2)
    q.push("a", 3)
    assert q.pending("a") == 3 and q.parked("a") == 2
    assert q.pop_round(5) == [("a", 3)]
    assert q.pop_round(5) == []  # parked items are not retried until the view changes
    q.push("a", 4)
    assert q.unpark() == 2
    assert q.pop_round(5) == [("a", 1), ("a", 2), ("a", 4)]


def test_retry_goes_to_the_front_and_unknown_queues_are_added():
    q = UserQueues(["a"])
    q.push("a", 1)
    q.push_front("a", 0)
    q.push("late", 9)
    assert q.pop_round(5) == [("a", 0), ("a", 1), ("late", 9)]


def test_remove_takes_matching_items_ready_and_parked_and_keeps_the_rest_in_order():
    q = UserQueues(["a", "b"])
    for i in range(6):
        q.push("a", i)
    q.push("b", 1)
    assert q.pop_round(3) == [("a", 0), ("a", 1), ("a", 2), ("b", 1)]
    q.park("a", 0)
    q.park("a", 1)
    assert q.remove("a", lambda item: item % 2 == 1) == [3, 5, 1]
    assert q.remove("missing", lambda item: True) == []
    assert q.pending("a") == 2 and q.parked("a") == 1
    assert q.pop_round(5) == [("a", 4)]
    assert q.unpark() == 1
    assert q.pop_round(5) == [("a", 0)]
