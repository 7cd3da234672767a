"""Azure Resource Central v2 ``vmtable.csv``: every column as VmRecord, deployments as jobs."""

import pytest

from loadgen.readers.azure import VmRecord, read_azure, read_azure_vms
from loadgen.trace import ReadStats, TraceError

ROWS = [
    "vm1,sub1,dep1,300,3900,98.5,20.25,90.1,Interactive,2,4",
    "vm2,sub1,dep1,0,600,50,10,40,Interactive,>24,>64",
    "vm3,sub2,dep2,100,200,10,1,5,Delay-insensitive,8,32",
]


def test_vm_records_keep_every_column(tmp_path):
    path = tmp_path / "vmtable.csv"
    path.write_text("\n".join(ROWS) + "\n")
    vms = list(read_azure_vms(path))
    assert vms[0] == VmRecord(
        vm_id="vm1",
        subscription_id="sub1",
        deployment_id="dep1",
        created_s=300.0,
        deleted_s=3900.0,
        max_cpu=98.5,
        avg_cpu=20.25,
        p95_max_cpu=90.1,
        category="Interactive",
        core_bucket="2",
        memory_bucket="4",
        cores=2.0,
        memory_gb=4.0,
    )
    assert vms[0].lifetime_s == 3600.0
    assert (vms[1].core_bucket, vms[1].cores, vms[1].memory_gb) == (">24", 32.0, 128.0)
    assert [v.vm_id for v in read_azure_vms(path, max_vms=2)] == ["vm1", "vm2"]


def test_deployments_become_jobs(tmp_path):
    path = tmp_path / "vmtable.csv"
    header = "vmid,subscriptionid,deploymentid,vmcreated,vmdeleted,maxcpu,avgcpu,p95maxcpu,"
    header += "vmcategory,vmcorecountbucket,vmmemorybucket"
    path.write_text("\n".join([header, *ROWS]) + "\n")
    jobs = list(read_azure(path))
    assert [(j.job_id, j.arrival_s, j.user) for j in jobs] == [
        ("dep1", 0.0, "sub1"),
        ("dep2", 100.0, "sub2"),
    ]
    assert jobs[0].durations_s == (3600.0, 600.0)
    assert [(t.cpu_milli, t.memory_mb) for t in jobs[0].tasks] == [(2000, 4096), (32000, 131072)]


def test_malformed_rows_with_file_and_line(tmp_path):
    path = tmp_path / "vmtable.csv"
    bad = [
        "vm4,sub1,dep1,500,400,1,1,1,Unknown,2,4",
        "vm5,sub1,dep1,1,2,1,1,1,Unknown,>48,4",
        "vm6,sub1,dep1,1,2,lots,1,1,Unknown,2,4",
    ]
    path.write_text("\n".join([ROWS[0], *bad, ROWS[2]]) + "\n")
    stats = ReadStats()
    assert [v.vm_id for v in read_azure_vms(path, stats=stats)] == ["vm1", "vm3"]
    assert stats.skipped == 3
    assert stats.problems[0] == "vmtable.csv:2: vmdeleted 400 is before vmcreated 500"
    assert stats.problems[1].startswith("vmtable.csv:3: unknown open vmcorecountbucket '>48'")
    assert stats.problems[2].startswith("vmtable.csv:4: maxcpu is not a number")
    with pytest.raises(TraceError, match=r"^vmtable\.csv:2:"):
        list(read_azure(path, strict=True))
