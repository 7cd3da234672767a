"""The trace flags every load-generator command shares, and turning them into jobs.

``add_trace_arguments(parser)`` adds them; ``jobs_from_args(args)`` reads the trace and
applies the augmentation they ask for, in this order:

    read (--format --strict --max-jobs) -> --cores-per-task -> Gridiron (--gridiron
    --bpc --peak-vdc --uplink-mbps) -> scaling (--cpu-scale --mem-scale) -> constraints
    (--constraints --seed)

Gridiron runs before scaling so bandwidth follows a task's real cores, not the
prototype's divided ones; scaling leaves ``net_mbps`` alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from loadgen.augment import (
    CLUSTERS,
    DEFAULT_MACHINES,
    ConstraintReport,
    cores_per_task,
    gridiron_bandwidth,
    machine_constraints,
    scale_resources,
    sharma_constraints,
    vlink_cap_mbps,
)
from loadgen.readers.dispatch import FORMATS, read_trace
from loadgen.trace import ReadStats, TraceJob
from services.common.argtypes import (
    bounded,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

CONSTRAINT_CHOICES = ("none", *(f"sharma-{c}" for c in CLUSTERS))
# Gridiron sweeps bpc; with no --bpc we use this middle value (an assumption, not Gridiron's
# default): a 1-core task then asks 100 Mbit/s per vlink, under the 177 Mbit/s cap.
DEFAULT_BPC_MBPS = 100.0
# Independent random streams from one --seed, so adding tasks never moves the machines.
_MACHINE_STREAM, _TASK_STREAM = 0, 1


def add_trace_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the trace-reading and augmentation flags (as an argument group) and return the
    group. The trace path itself stays the command's own argument (``args.trace``)."""
    group = parser.add_argument_group("trace reading and augmentation")
    group.add_argument(
        "--format",
        choices=FORMATS,
        help="trace format (default: from the file name: *.tr, instance_events*, "
        "batch_task*, vmtable*)",
    )
    group.add_argument(
        "--strict", action="store_true", help="stop at the first malformed line (default: skip)"
    )
    group.add_argument("--max-jobs", type=positive_int, help="read only the first N jobs")
    group.add_argument(
        "--constraints",
        choices=CONSTRAINT_CHOICES,
        default="none",
        help="synthesise placement constraints after Sharma et al. for cluster A, B or C",
    )
    group.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed for synthesised constraints"
    )
    group.add_argument(
        "--gridiron", action="store_true", help="derive per-task net_mbps from VDCs (Gridiron)"
    )
    group.add_argument(
        "--bpc",
        type=non_negative_float,
        help=f"Gridiron bandwidth per core, Mbit/s (implies --gridiron; default "
        f"{DEFAULT_BPC_MBPS:g})",
    )
    group.add_argument(
        "--peak-vdc", type=_vdc_size, default=30, help="Gridiron peak VDC size P (default 30)"
    )
    group.add_argument(
        "--uplink-mbps",
        type=positive_float,
        default=40_000.0,
        help="Gridiron fattest server uplink C, Mbit/s (default 40000: vlink cap 177)",
    )
    group.add_argument(
        "--cpu-scale", type=positive_float, help="divide CPU requests by this (paper: 400)"
    )
    group.add_argument(
        "--mem-scale", type=positive_float, help="divide memory requests by this (paper: 50)"
    )
    group.add_argument(
        "--cores-per-task",
        type=positive_float,
        help="give every task this many cores (.tr traces carry no requests; default 1)",
    )
    return group


def jobs_from_args(
    args: argparse.Namespace, path: str | Path | None = None
) -> tuple[list[TraceJob], ReadStats]:
    """Read ``path`` (default ``args.trace``) and augment it as the flags ask.

    Constraints are made satisfiable against ``machines_from_args(args)``; a simulator
    that calls the same function for its workers gets exactly those machines. What the
    augmentation did is summarised in ``stats.notes``. Raises ``TraceError`` for a bad
    file or (``--strict``) line, ``ValueError`` when no trace path was given.
    """
    path = path if path is not None else getattr(args, "trace", None)
    if path is None:
        raise ValueError("no trace file given")
    stats = ReadStats()
    jobs = list(read_trace(path, args.format, args.strict, args.max_jobs, stats))
    if args.cores_per_task is not None:
        jobs = cores_per_task(jobs, round(args.cores_per_task * 1000))
    if args.gridiron or args.bpc is not None:
        bpc = DEFAULT_BPC_MBPS if args.bpc is None else args.bpc
        jobs = gridiron_bandwidth(jobs, bpc, args.peak_vdc, args.uplink_mbps)
        cap = vlink_cap_mbps(args.peak_vdc, args.uplink_mbps)
        stats.notes.append(
            f"gridiron: bpc {bpc:g} Mbit/s per core, VDCs of at most {args.peak_vdc}, "
            f"vlink cap {cap} Mbit/s"
        )
    if args.cpu_scale is not None or args.mem_scale is not None:
        jobs = scale_resources(jobs, args.cpu_scale or 1, args.mem_scale or 1)
    machines = machines_from_args(args)
    if machines is not None:
        report = ConstraintReport()
        rng = np.random.default_rng([args.seed, _TASK_STREAM])
        jobs = sharma_constraints(jobs, _cluster(args), rng, machines=machines, report=report)
        stats.notes.append(report.render())
    return jobs, stats


def machines_from_args(
    args: argparse.Namespace, num_machines: int | None = None
) -> np.ndarray | None:
    """The machines' constraint masks for ``--constraints`` (None when it is ``none``).

    ``num_machines`` defaults to ``args.workers`` when the command has that flag, else
    DEFAULT_MACHINES. Same arguments, same masks: the simulator and ``jobs_from_args``
    agree on which machine satisfies what.
    """
    if args.constraints == "none":
        return None
    if num_machines is None:
        num_machines = getattr(args, "workers", None) or DEFAULT_MACHINES
    rng = np.random.default_rng([args.seed, _MACHINE_STREAM])
    return machine_constraints(num_machines, _cluster(args), rng)


def _cluster(args: argparse.Namespace) -> str:
    return args.constraints.removeprefix("sharma-")


_vdc_size = bounded(int, "vdc_size", 2)
