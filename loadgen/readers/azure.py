"""Azure Resource Central (AzurePublicDatasetV2, 2019) ``vmtable.csv`` -> VMs and jobs.

The published file has no header; its columns, in order (github.com/Azure/
AzurePublicDataset, ``AzurePublicDatasetV2.md`` and its analysis notebook):

====  =================  ================================================================
 col  name               meaning
====  =================  ================================================================
  0   vmid               encrypted VM id
  1   subscriptionid     encrypted subscription id (used as ``TraceJob.user``)
  2   deploymentid       encrypted deployment id: the job, and Gridiron's VDC
  3   vmcreated          seconds since the trace start
  4   vmdeleted          seconds; VMs alive at the end carry the trace's last timestamp
  5   maxcpu             max CPU utilisation, percent
  6   avgcpu             average CPU utilisation, percent
  7   p95maxcpu          95th percentile of the 5-minute maxima, percent
  8   vmcategory         ``Delay-insensitive`` / ``Interactive`` / ``Unknown``
  9   vmcorecountbucket  virtual cores: ``2``, ``4``, ``8``, ``24`` or ``>24``
 10   vmmemorybucket     memory in GB: ``2``, ``4``, ``8``, ``32``, ``64`` or ``>64``
====  =================  ================================================================

A header row naming these columns is accepted too. ``read_azure_vms`` yields every column
(``VmRecord``) in file order for VM-allocation simulators; ``read_azure`` groups VMs into
one ``TraceJob`` per deployment: it arrives with its first VM, and each VM is a task lasting
``vmdeleted - vmcreated`` with the bucket's cores and memory. The open-ended buckets have
no upper bound in the data; ``>24`` is read as 32 cores and ``>64`` as 128 GB (assumed: the
next size up that Azure sells).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadgen.readers._csv import field_at, header_index, is_header, number, numbered_rows
from loadgen.trace import ReadStats, TraceError, TraceJob, TraceTask

COLUMNS = (
    "vmid",
    "subscriptionid",
    "deploymentid",
    "vmcreated",
    "vmdeleted",
    "maxcpu",
    "avgcpu",
    "p95maxcpu",
    "vmcategory",
    "vmcorecountbucket",
    "vmmemorybucket",
)
OPEN_BUCKETS = {">24": 32.0, ">64": 128.0}  # see the module doc: an assumption


@dataclass(frozen=True, slots=True)
class VmRecord:
    """One row of ``vmtable.csv``, every column kept."""

    vm_id: str
    subscription_id: str
    deployment_id: str
    created_s: float
    deleted_s: float
    max_cpu: float
    avg_cpu: float
    p95_max_cpu: float
    category: str
    core_bucket: str  # as published, e.g. ">24"
    memory_bucket: str  # GB, as published
    cores: float  # the bucket read as a number (see OPEN_BUCKETS)
    memory_gb: float

    @property
    def lifetime_s(self) -> float:
        return self.deleted_s - self.created_s


def read_azure_vms(
    path: str | Path,
    strict: bool = False,
    max_vms: int | None = None,
    stats: ReadStats | None = None,
) -> Iterator[VmRecord]:
    """Yield the VMs of a ``vmtable.csv`` in file order. Malformed rows raise
    (``strict``) or are skipped and counted in ``stats`` with file and line number."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    positions: dict[str, int] | None = None
    yielded = 0
    for where, row in numbered_rows(path, stats):
        if max_vms is not None and yielded >= max_vms:
            return
        if positions is None:
            positions = {name: i for i, name in enumerate(COLUMNS)}
            if is_header(row, COLUMNS):
                positions = header_index(row, {c: (c,) for c in COLUMNS})
                missing = [c for c in COLUMNS if c not in positions]
                if missing:
                    raise TraceError(f"{where}: header has no {', '.join(missing)} column")
                continue
        try:
            vm = _parse(row, positions, where)
        except TraceError as err:
            stats.malformed(err, strict)
            continue
        yielded += 1
        yield vm


def read_azure(
    path: str | Path,
    strict: bool = False,
    max_jobs: int | None = None,
    stats: ReadStats | None = None,
) -> Iterator[TraceJob]:
    """Yield one job per deployment, sorted by arrival (its first VM's creation)."""
    stats = stats if stats is not None else ReadStats()
    tasks: dict[str, list[TraceTask]] = defaultdict(list)
    arrival: dict[str, float] = {}
    user: dict[str, str] = {}
    for vm in read_azure_vms(path, strict=strict, stats=stats):
        job = vm.deployment_id
        tasks[job].append(
            TraceTask(
                duration_s=vm.lifetime_s,
                cpu_milli=math.ceil(vm.cores * 1000),
                memory_mb=math.ceil(vm.memory_gb * 1024),
            )
        )
        arrival[job] = min(vm.created_s, arrival.get(job, vm.created_s))
        user.setdefault(job, vm.subscription_id)
    order = sorted(arrival, key=lambda j: (arrival[j], j))
    for job in order[:max_jobs]:
        stats.jobs += 1
        yield TraceJob(job_id=job, arrival_s=arrival[job], tasks=tuple(tasks[job]), user=user[job])


def _parse(row: list[str], positions: dict[str, int], where: str) -> VmRecord:
    def cell(name: str) -> str:
        return field_at(row, positions[name], name, where).strip()

    created = number(cell("vmcreated"), "vmcreated", where)
    deleted = number(cell("vmdeleted"), "vmdeleted", where)
    if created < 0 or deleted < created:
        raise TraceError(f"{where}: vmdeleted {deleted:g} is before vmcreated {created:g}")
    if not cell("deploymentid"):
        raise TraceError(f"{where}: deploymentid is empty")
    core_bucket, memory_bucket = cell("vmcorecountbucket"), cell("vmmemorybucket")
    return VmRecord(
        vm_id=cell("vmid"),
        subscription_id=cell("subscriptionid"),
        deployment_id=cell("deploymentid"),
        created_s=created,
        deleted_s=deleted,
        max_cpu=number(cell("maxcpu"), "maxcpu", where),
        avg_cpu=number(cell("avgcpu"), "avgcpu", where),
        p95_max_cpu=number(cell("p95maxcpu"), "p95maxcpu", where),
        category=cell("vmcategory"),
        core_bucket=core_bucket,
        memory_bucket=memory_bucket,
        cores=_bucket(core_bucket, "vmcorecountbucket", where),
        memory_gb=_bucket(memory_bucket, "vmmemorybucket", where),
    )


def _bucket(text: str, what: str, where: str) -> float:
    if text in OPEN_BUCKETS:
        return OPEN_BUCKETS[text]
    if text.startswith(">"):
        raise TraceError(f"{where}: unknown open {what} {text!r}; known: {sorted(OPEN_BUCKETS)}")
    value = number(text, what, where)
    if value <= 0:
        raise TraceError(f"{where}: {what} must be > 0, got {text!r}")
    return value
