from hypothesis import given
from hypothesis import strategies as st

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


def test_higher_priorities_go_first_and_one_priority_keeps_its_order():
    q = UserQueues(["a", "b"], priority=lambda item: item[0])
    for item in [(0, "x"), (5, "y"), (0, "z"), (-1, "w"), (5, "v")]:
        q.push("a", item)
    q.push("b", (9, "b1"))
    assert q.pop_round(3) == [("a", (5, "y")), ("a", (5, "v")), ("a", (0, "x")), ("b", (9, "b1"))]
    assert q.ready("a") == 2 and len(q) == 2
    q.push_front("a", (0, "retry"))  # a rejected launch: first of its priority
    assert q.pop_round(5) == [("a", (0, "retry")), ("a", (0, "z")), ("a", (-1, "w"))]


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(-2, 2)),
            st.tuples(st.just("push_front"), st.integers(-2, 2)),
            st.tuples(st.just("pop"), st.integers(1, 4)),
            st.tuples(st.just("park_popped"), st.just(0)),
            st.tuples(st.just("unpark"), st.just(0)),
            st.tuples(st.just("remove_odd"), st.just(0)),
        ),
        max_size=60,
    )
)
def test_priorities_against_a_sorted_list(ops):
    """Model: the ready items as a list kept in (-priority, position) order, positions
    counting down for push_front and unpark, up for push; parked items apart."""
    q = UserQueues(["a"], priority=lambda item: item[0])
    ready: list[tuple[int, float, tuple[int, int]]] = []  # (-priority, position, item)
    parked: list[tuple[int, int]] = []
    popped: list[tuple[int, int]] = []
    back, front, serial = 0.0, 0.0, 0
    for op, arg in ops:
        if op in ("push", "push_front"):
            serial += 1
            item = (arg, serial)
            if op == "push":
                back += 1
                ready.append((-arg, back, item))
                q.push("a", item)
            else:
                front -= 1
                ready.append((-arg, front, item))
                q.push_front("a", item)
        elif op == "pop":
            ready.sort()
            want = [item for _, _, item in ready[:arg]]
            del ready[:arg]
            assert q.pop_round(arg) == [("a", item) for item in want]
            popped.extend(want)
        elif op == "park_popped" and popped:
            item = popped.pop(0)
            parked.append(item)
            q.park("a", item)
        elif op == "unpark":
            for item in reversed(parked):
                front -= 1
                ready.append((-item[0], front, item))
            assert q.unpark() == len(parked)
            parked.clear()
        elif op == "remove_odd":
            dropped = q.remove("a", lambda item: item[1] % 2 == 1)
            expect = sorted(item for _, _, item in ready if item[1] % 2 == 1)
            expect += [item for item in parked if item[1] % 2 == 1]
            assert sorted(dropped) == sorted(expect)
            ready = [r for r in ready if r[2][1] % 2 == 0]
            parked = [item for item in parked if item[1] % 2 == 0]
        assert q.ready("a") == len(ready) and q.parked("a") == len(parked)
        assert len(q) == len(ready) + len(parked)


def test_with_an_age_unpark_keeps_older_ready_items_ahead_of_the_parked():
    # Issue 29: a launch an LM refused goes back to the front while a younger backlog is
    # parked; the view changes and the backlog went back ahead of it, so it waited behind
    # every younger job of its GM (9,900 s in the Yahoo sample at 3,000 workers).
    def filled(age):
        q = UserQueues(["a"], age=age)
        for item in (5, 6, 7):
            q.push("a", item)
        assert q.pop_round(3) == [("a", 5), ("a", 6), ("a", 7)]
        q.park("a", 6)
        q.park("a", 7)
        q.push_front("a", 5)  # refused by an LM: older than the parked
        q.push("a", 9)
        assert q.unpark() == 2
        return q.pop_round(9)

    assert filled(lambda item: item) == [("a", 5), ("a", 6), ("a", 7), ("a", 9)]
    assert filled(None) == [("a", 6), ("a", 7), ("a", 5), ("a", 9)]  # insertion order


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=40))
def test_with_an_age_the_parked_come_back_in_age_order_ahead_of_younger_ready_items(ops):
    """Whatever was parked and pushed to the front meanwhile, after ``unpark`` the parked
    items come out oldest first, each ahead of every ready item younger than it."""
    q = UserQueues(["a"], age=lambda item: item[0])
    parked = set()
    for serial, (park, age) in enumerate(ops):
        item = (age, serial)
        if park:
            q.park("a", item)
            parked.add(item)
        else:
            q.push_front("a", item)
    assert q.unpark() == len(parked)
    out = [item for _, item in q.pop_round(len(ops) + 1)]
    assert len(out) == len(ops)
    back = [item for item in out if item in parked]
    assert [age for age, _ in back] == sorted(age for age, _ in back)
    at = {item: i for i, item in enumerate(out)}
    for p in parked:
        assert all(at[p] < at[r] for r in out if r not in parked and r[0] > p[0])
