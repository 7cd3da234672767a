"""The synthetic VM trace has the paper's properties, and the CSV format round-trips."""

import gzip

import numpy as np
import pytest

from loadgen.trace import ReadStats
from loadgen.vm_trace import (
    FIXED_COLUMNS,
    TraceError,
    VmTrace,
    azure_vm_trace,
    group_lifetimes,
    read_vm_csv,
    read_vm_trace,
    synthetic_vm_trace,
    trace_properties,
    write_azure_vmtable,
    write_vm_csv,
)

H = 3600.0


@pytest.fixture(scope="module")
def trace():
    return synthetic_vm_trace(vms=20_000, days=7, seed=3)


def test_most_vms_are_short_but_most_core_hours_are_long(trace):
    props = trace_properties(trace)
    assert props["vms"] == 20_000
    assert 0.86 <= props["vms_under_1h"] <= 0.91  # paper: about 88 %
    assert props["core_hours_1h_plus"] >= 0.965  # paper: about 98 %


def test_lifetimes_are_bimodal_within_one_feature_group(trace):
    keys = ("user", "category", "priority", "cores", "memory_gb")
    bimodal = [
        life
        for life in group_lifetimes(trace, keys).values()
        if len(life) >= 100 and (life < H).mean() >= 0.3 and (life > 10 * H).mean() >= 0.1
    ]
    assert bimodal, "no feature group with both a short and a long mode"
    # Two modes, not one spread: little mass between 1 h and 3 h compared to either side.
    life = max(bimodal, key=len)
    between = ((life >= H) & (life < 3 * H)).mean()
    assert between < (life < H).mean() / 3 and between < (life >= 3 * H).mean()


def deployments_of(trace):
    """VM rows per deployment, from the synthetic ids ``d<deployment>-<k>``."""
    groups = {}
    for i, vm_id in enumerate(trace.vm_ids):
        groups.setdefault(vm_id.split("-")[0], []).append(i)
    return {d: np.array(rows) for d, rows in groups.items()}


def test_vms_of_a_deployment_come_together_and_live_alike(trace):
    groups = deployments_of(trace)
    sizes = np.array([len(rows) for rows in groups.values()])
    assert 0.55 <= (sizes == 1).mean() <= 0.7 and sizes.max() <= 32  # P(k) ~ 1/k^2
    spread, across = [], []
    for rows in groups.values():
        if len(rows) < 4:
            continue
        # One user, one shape, created within a minute, one size feature.
        for column in ("user", "cores", "memory_gb", "deployment_size"):
            assert len(set(trace.features[column][rows])) == 1
        assert np.ptp(trace.arrival_s[rows]) <= 60.0
        # All of it, unless some of a prehistory deployment had ended before time 0.
        size = int(trace.features["deployment_size"][rows[0]])
        assert size == len(rows) or (size > len(rows) and trace.arrival_s[rows[0]] < 0)
        spread.append(np.std(np.log(trace.lifetime_s[rows])))
    # Alike within a deployment (sigma 0.1), far apart across one user's deployments.
    users = trace.features["user"]
    for user in set(users[:500]):
        first = [rows[0] for rows in groups.values() if users[rows[0]] == user]
        if len(first) >= 20:
            across.append(np.std(np.log(trace.lifetime_s[first])))
    assert spread and across
    assert np.median(spread) < 0.15 and np.median(across) > 1.0


def test_without_deployments_every_vm_is_its_own():
    trace = synthetic_vm_trace(vms=2_000, days=2, seed=3, deployments=False)
    assert set(trace.features["deployment_size"]) == {"1"}
    assert len(deployments_of(trace)) == len(trace)
    props = trace_properties(trace)
    assert 0.85 <= props["vms_under_1h"] <= 0.92


def test_prehistory_vms_are_running_at_time_zero(trace):
    early = trace.arrival_s < 0
    assert early.any()
    assert np.all(trace.arrival_s[early] + trace.lifetime_s[early] > 0)
    assert np.all(np.diff(trace.arrival_s) >= 0)


def test_seeds_vary_the_vms_but_not_the_population():
    a = synthetic_vm_trace(vms=2_000, seed=1, prehistory_days=0)
    b = synthetic_vm_trace(vms=2_000, seed=1, prehistory_days=0)
    c = synthetic_vm_trace(vms=2_000, seed=2, prehistory_days=0)
    assert np.array_equal(a.lifetime_s, b.lifetime_s)
    assert not np.array_equal(a.lifetime_s, c.lifetime_s)
    # The same users keep their shapes: a user's shapes in c are among its shapes in a.
    for user in set(a.features["user"][:200]):
        shapes_a = set(
            zip(
                a.cpu_milli[a.features["user"] == user],
                a.memory_mb[a.features["user"] == user],
                strict=True,
            )
        )
        shapes_c = set(
            zip(
                c.cpu_milli[c.features["user"] == user],
                c.memory_mb[c.features["user"] == user],
                strict=True,
            )
        )
        assert len(shapes_a | shapes_c) <= 3


def test_csv_round_trip(tmp_path):
    trace = synthetic_vm_trace(vms=300, days=1, seed=5)
    path = write_vm_csv(trace, tmp_path / "vms.csv")
    assert path.read_text().splitlines()[0].startswith(",".join(FIXED_COLUMNS))
    back = read_vm_csv(path)
    assert len(back) == len(trace)
    assert np.allclose(back.arrival_s, trace.arrival_s, atol=1e-3)
    assert np.allclose(back.lifetime_s, trace.lifetime_s, atol=1e-3)
    assert np.array_equal(back.cpu_milli, trace.cpu_milli)
    assert back.feature_dicts()[:5] == trace.feature_dicts()[:5]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("a,b\n1,2\n", "header must start with"),
        (
            "vm_id,arrival_s,lifetime_s,cpu_milli,memory_mb,user\nv1,0,10,1000,512\n",
            ":2: 5 columns",
        ),
        (
            "vm_id,arrival_s,lifetime_s,cpu_milli,memory_mb\nv1,0,0,1000,512\n",
            ":2: lifetime_s must be > 0",
        ),
        ("vm_id,arrival_s,lifetime_s,cpu_milli,memory_mb\nv1,zero,5,1000,512\n", "non-number"),
        ("vm_id,arrival_s,lifetime_s,cpu_milli,memory_mb\n", "no VMs"),
    ],
)
def test_bad_csv_says_where_and_why(tmp_path, text, reason):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=reason):
        read_vm_csv(path)
    with pytest.raises(TraceError, match="No such file"):
        read_vm_csv(tmp_path / "missing.csv")


def test_mismatched_columns_are_rejected():
    with pytest.raises(TraceError, match="lifetime_s has 1 values for 2 VMs"):
        VmTrace(np.zeros(2), np.ones(1), np.ones(2), np.ones(2), {})


AZURE_ROWS = [
    "vm1,sub1,dep1,300,3900,98.5,20.25,90.1,Interactive,2,4",
    "vm2,sub1,dep1,0,600,50,10,40,Interactive,>24,>64",
    "vm3,sub2,dep2,1200,1200,10,1,5,Delay-insensitive,8,32",
    "vm4,sub2,dep3,oops,1500,10,1,5,Unknown,8,32",
]


def test_azure_vmtable_reads_as_a_vm_trace(tmp_path):
    path = tmp_path / "vmtable.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(AZURE_ROWS) + "\n")
    stats = ReadStats()
    trace = azure_vm_trace(path, stats=stats)

    assert list(trace.vm_ids) == ["vm2", "vm1", "vm3"]  # sorted by creation
    assert stats.skipped == 1 and "vmcreated" in stats.problems[0]
    assert trace.arrival_s.tolist() == [0.0, 300.0, 1200.0]
    # vm3 was created and deleted in one 5-minute tick: half a tick.
    assert trace.lifetime_s.tolist() == [600.0, 3600.0, 150.0]
    assert trace.cpu_milli.tolist() == [32_000, 2_000, 8_000]  # ">24" read as 32 cores
    assert trace.memory_mb.tolist() == [128 * 1024, 4 * 1024, 32 * 1024]
    assert trace.feature_dicts()[1] == {
        "user": "sub1",
        "category": "interactive",
        "cores": "2",
        "memory_gb": "4",
        "deployment_size": "2",
    }
    # The same file through the format-sniffing reader; our CSV through it too.
    assert list(read_vm_trace(path).vm_ids) == ["vm2", "vm1", "vm3"]
    ours = write_vm_csv(trace, tmp_path / "vms.csv")
    assert read_vm_trace(ours).feature_dicts() == trace.feature_dicts()


def test_azure_vmtable_without_vms_is_an_error(tmp_path):
    path = tmp_path / "vmtable.csv"
    path.write_text(AZURE_ROWS[-1] + "\n")
    with pytest.raises(TraceError, match="no VMs"):
        read_vm_trace(path)
    with pytest.raises(TraceError, match="No such file"):
        read_vm_trace(tmp_path / "missing.csv")


@pytest.mark.parametrize("name", ["vmtable.csv", "vmtable.csv.gz"])
def test_a_trace_written_in_azures_layout_reads_back(tmp_path, name):
    trace = synthetic_vm_trace(vms=1_500, days=1, seed=8, prehistory_days=2)
    back = read_vm_trace(write_azure_vmtable(trace, tmp_path / name))
    assert len(back) == len(trace)
    by_id = {v: i for i, v in enumerate(back.vm_ids)}
    rows = np.array([by_id[v] for v in trace.vm_ids])
    # Running before 0 becomes created at 0 (as Azure shows old VMs); exits are kept.
    assert np.allclose(back.arrival_s[rows], np.maximum(trace.arrival_s, 0), atol=0.5)
    ends = trace.arrival_s + trace.lifetime_s
    assert np.allclose(back.arrival_s[rows] + back.lifetime_s[rows], ends, atol=1.0)
    assert np.array_equal(back.cpu_milli[rows], trace.cpu_milli)
    assert np.array_equal(back.memory_mb[rows], trace.memory_mb)
    for feature in ("user", "category", "cores", "memory_gb"):
        assert list(back.features[feature][rows]) == list(trace.features[feature]), feature
    # deployment_size counts a deployment's VMs in the table; the prehistory dropped the
    # VMs that had ended before 0, so compare on a trace without one.
    fresh = synthetic_vm_trace(vms=1_500, days=1, seed=8, prehistory_days=0)
    again = read_vm_trace(write_azure_vmtable(fresh, tmp_path / f"fresh-{name}"))
    assert sorted(again.features["deployment_size"]) == sorted(fresh.features["deployment_size"])
