import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.resources import NET, resources
from services.core.status import Schedulability
from services.core.vdc import (
    NOT_PLACED,
    UNJUDGED,
    Colocate,
    Packing,
    Vdc,
    VdcError,
    fits_uplinks,
    member_uplink,
    uplink_demand,
)

NODE = resources(cpu_milli=4000, memory_mb=8192, disk_mb=1000, net_mbps=1000)


def nodes(count: int, node: np.ndarray = NODE) -> np.ndarray:
    return np.tile(node[:, None], (1, count))


def members(count: int, cpu: int = 1000, net: int = 0) -> np.ndarray:
    return np.tile(resources(cpu, 1024, 0, net), (count, 1))


@pytest.mark.parametrize(
    ("bpc", "cap", "message"),
    [
        (-1, 100, "bandwidth_per_core must be finite and >= 0"),
        (10, math.inf, "vlink_cap must be finite"),
        (math.nan, 100, "bandwidth_per_core must be finite"),
        ("10", 100, "must be a number of Mbit/s"),
        (True, 100, "must be a number of Mbit/s"),
    ],
)
def test_a_bad_vdc_says_which_parameter_is_wrong(bpc, cap, message):
    with pytest.raises(VdcError, match=message):
        Vdc(bpc, cap)


def test_uniform_members_send_d_times_p_minus_d_vlinks():
    vdc = Vdc(bandwidth_per_core=100, vlink_cap=177)
    slots = np.array([0, 0, 0, 1, 1, 2])  # D = 3, 2, 1 of P = 6
    demand = uplink_demand(vdc, np.full(6, 1000), slots, 4)
    assert demand.tolist() == [3 * 3 * 100, 2 * 4 * 100, 1 * 5 * 100, 0]


def test_vlinks_are_capped_and_follow_the_smaller_end():
    vdc = Vdc(bandwidth_per_core=100, vlink_cap=177)
    links = vdc.vlinks_kbps(np.array([1000, 4000, 500]))
    assert links.tolist() == [[0, 100_000, 50_000], [100_000, 0, 50_000], [50_000, 50_000, 0]]
    assert Vdc(100, 150).vlinks_kbps(np.array([4000, 4000]))[0, 1] == 150_000


@settings(max_examples=60, deadline=None)
@given(
    cpu=st.lists(st.integers(100, 8000), min_size=1, max_size=12),
    data=st.data(),
    bpc=st.floats(0, 500),
    cap=st.floats(0, 1000),
)
def test_uplink_demand_is_the_sum_of_vlinks_leaving_each_node(cpu, data, bpc, cap):
    slots = np.array(data.draw(st.lists(st.integers(-1, 4), min_size=len(cpu), max_size=len(cpu))))
    vdc = Vdc(bpc, cap)
    cpu = np.array(cpu)
    # Brute force over pairs, each vlink rounded up to kbit/s, each member's share to Mbit/s.
    expected = np.zeros(5, dtype=np.int64)
    for i in range(len(cpu)):
        if slots[i] < 0:
            continue
        kbps = 0
        for j in range(len(cpu)):
            if j != i and slots[j] != slots[i]:
                mbps = min(bpc * min(cpu[i], cpu[j]) / 1000, cap)
                kbps += math.ceil(mbps * 1000 - 1e-6)
        expected[slots[i]] += -(-kbps // 1000)
    assert uplink_demand(vdc, cpu, slots, 5).tolist() == expected.tolist()
    assert member_uplink(vdc, cpu, slots)[slots == NOT_PLACED].sum() == 0


def test_fits_uplinks_names_the_node_and_the_numbers():
    vdc = Vdc(100, 177)
    slots = np.array([0, 0, 1, 1])
    fit = fits_uplinks(vdc, np.full(4, 1000), slots, np.array([400, 399]), ["w0", "w1"])
    assert not fit and fit.demand.tolist() == [400, 400]
    assert fit.reason == (
        "node w1 would carry 400 Mbit/s of VDC traffic (2 of 4 members there) over an "
        "uplink with 399 Mbit/s free"
    )
    # A node shown booked past its uplink is no reason to refuse a VDC that avoids it.
    assert fits_uplinks(vdc, np.full(4, 1000), slots, np.array([400, 400, -1400]))
    # An LM judges only its own nodes.
    assert fits_uplinks(vdc, np.full(4, 1000), slots, np.array([400, UNJUDGED]))


def test_colocation_saves_the_uplink_spreading_would_need():
    # 8 one-core members, vlinks of 200 Mbit/s, uplinks of 1000: alone on a node a member
    # sends 7 x 200 = 1400, four together 4 x 4 x 200 = 3200; only all eight on the one
    # big node send nothing, and the packer must find it.
    vdc = Vdc(200, 500)
    big = resources(8000, 16384, 1000, 1000)
    free = np.concatenate([nodes(3), big[:, None]], axis=1)
    packing = Colocate().place(members(8), free, free, vdc)
    assert isinstance(packing, Packing)
    assert packing.slots.tolist() == [3] * 8
    assert packing.booked[:, NET].tolist() == [0] * 8


def test_a_member_books_its_uplink_share_not_its_own_net_request():
    vdc = Vdc(100, 177)
    packing = Colocate().place(members(6, net=500), nodes(4), nodes(4), vdc)
    assert isinstance(packing, Packing)
    assert sorted(np.bincount(packing.slots).tolist()) == [2, 4]
    # Four together send 4 x 2 x 100; the other two 2 x 4 x 100; 200 and 400 a member.
    assert sorted(packing.booked[:, NET].tolist()) == [200, 200, 200, 200, 400, 400]


def test_waiting_is_told_apart_from_never():
    taken = nodes(2)
    taken[0] = 500  # cpu mostly taken now
    later = Colocate().place(members(8), taken, nodes(2))
    assert later.schedulability is Schedulability.UNSCHEDULABLE
    assert later.reason == (
        "waiting for room for the whole gang (8 of its 8 members together): all the room "
        "together is short of cpu_milli: the members need at least cpu=8 mem=8192Mi disk=0Mi "
        "net=0M, the nodes have cpu=1 mem=16384Mi disk=2000Mi net=2000M"
    )
    never = Colocate().place(members(9), nodes(2), nodes(2))
    assert never.schedulability is Schedulability.INFEASIBLE
    assert never.reason.startswith(
        "the gang cannot start even on empty nodes (9 of its 9 members together): all the "
        "room together is short of cpu_milli"
    )
    # Enough room in total, but in pieces: 2.5 cores free on each node, 1.5 per member.
    fragmented = nodes(2)
    fragmented[0] = 2500
    split = Colocate().place(members(3, cpu=1500), fragmented, nodes(2))
    assert split.schedulability is Schedulability.UNSCHEDULABLE
    assert split.reason.endswith(
        "2 placed, then every one of the 2 usable nodes already took members"
    )
    # Uplink alone can make it never: 8 members of 300 Mbit/s vlinks, nodes of 4 cores.
    uplink = Colocate().place(members(8), nodes(2), nodes(2), Vdc(300, 1000))
    assert uplink.schedulability is Schedulability.INFEASIBLE
    assert "0 placed, then the nodes with room lack uplink" in uplink.reason
    assert "the most free uplink among them is 1000" in uplink.reason


def test_min_members_is_enough():
    packing = Colocate().place(members(10), nodes(2), nodes(2), min_members=8)
    assert isinstance(packing, Packing) and packing.placed == 8
    assert (packing.slots == NOT_PLACED).sum() == 2
    with pytest.raises(ValueError, match=r"min_members must be in 1\.\.10"):
        Colocate().place(members(10), nodes(2), nodes(2), min_members=11)


request = st.tuples(st.integers(1, 4000), st.integers(0, 8192), st.integers(0, 10), st.just(0))
# Free room may be negative: a GM's view shows a node booked past its capacity for a
# moment when two GMs took the same room.
node_free = st.tuples(
    st.integers(-1000, 8000), st.integers(0, 16384), st.integers(0, 20), st.integers(-500, 3000)
)


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.lists(request, min_size=1, max_size=10),
    free=st.lists(node_free, min_size=1, max_size=8),
    vdc=st.none() | st.builds(Vdc, st.floats(0, 300), st.floats(0, 400)),
    need=st.integers(1, 10),
)
def test_a_packing_is_whole_and_never_over_commits_a_node_or_an_uplink(reqs, free, vdc, need):
    requests = np.array(reqs, dtype=np.int64)
    free = np.array(free, dtype=np.int64).T
    need = min(need, len(requests))
    outcome = Colocate().place(requests, free, free, vdc, need)
    if not isinstance(outcome, Packing):
        assert outcome.schedulability is not Schedulability.SCHEDULABLE
        return
    placed = outcome.slots >= 0
    assert outcome.placed == placed.sum() >= need
    used = np.zeros_like(free)
    for member in np.flatnonzero(placed):
        used[:, outcome.slots[member]] += outcome.booked[member]
    hosting = np.unique(outcome.slots[placed])
    assert (used[:, hosting] <= free[:, hosting]).all()
    if vdc is not None:
        demand = uplink_demand(vdc, requests[:, 0], outcome.slots, free.shape[1])
        assert (demand == used[NET]).all()  # the booked net is exactly the VDC's traffic
        assert fits_uplinks(vdc, requests[:, 0], outcome.slots, free[NET])
