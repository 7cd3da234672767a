"""Trace readers: every published layout in, one canonical ``TraceJob`` model out.

    file ──read_trace(fmt | file name)──> tr | google2019 | alibaba2018 | azure
         ──> Iterator[TraceJob] (+ ReadStats: lines, jobs, malformed, incomplete)
         ──jobs_from_args──> cores / Gridiron / scaling / Sharma constraints ──> list

Malformed lines are ``TraceError("file:line: reason")``: ``strict`` raises the first, the
default skips it and counts it in ``ReadStats`` (the first few messages are kept).
"""

from __future__ import annotations

from loadgen.readers.alibaba2018 import read_alibaba2018
from loadgen.readers.azure import VmRecord, read_azure, read_azure_vms
from loadgen.readers.dispatch import FORMATS, READERS, guess_format, read_trace
from loadgen.readers.google2019 import read_google2019
from loadgen.readers.options import add_trace_arguments, jobs_from_args, machines_from_args
from loadgen.trace import ReadStats, TraceError

__all__ = [
    "FORMATS",
    "READERS",
    "ReadStats",
    "TraceError",
    "VmRecord",
    "add_trace_arguments",
    "guess_format",
    "jobs_from_args",
    "machines_from_args",
    "read_alibaba2018",
    "read_azure",
    "read_azure_vms",
    "read_google2019",
    "read_trace",
]
