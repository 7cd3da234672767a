"""``megha nodes``: every worker node as its LM holds it, one line each.

    each LM of the config ──GetState (full)──▶ nodes, free columns, allocations
                         ──DrainNode(query)──▶ its draining nodes
        ──node_rows──▶ NODE  LM  GM  STATE  CPU free/total  MEM free/total  TASKS  CONSTRAINTS

Asked of the LMs, not of a GM: what they hold is the truth a GM's view follows. An LM
that does not answer is named on stderr and the others are still shown (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import grpc

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.common.config import FederationConfig
from services.common.server import channel
from services.core.constraints import ConstraintError, from_mask, parse_constraints
from services.core.resources import CPU, format_quantity

_HEALTH = {common_pb2.NODE_HEALTH_ALIVE: "alive", common_pb2.NODE_HEALTH_DEAD: "dead"}


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    lm_id: str
    gm_id: str  # the GM whose partition owns the node
    state: str  # alive, dead or draining
    cpu_free_milli: int
    cpu_milli: int
    memory_free_mb: int
    memory_mb: int
    tasks: int
    constraints: list[int]
    address: str = ""  # what the node's worker host advertises (its group's host)


def node_rows(
    state: common_pb2.LocalMasterState, draining: set[str] | frozenset[str] = frozenset()
) -> list[NodeRow]:
    """The nodes of one LM's full state, in the LM's order."""
    free = {
        index: (cpu, mem)
        for index, cpu, mem in zip(
            state.free.indices, state.free.cpu_milli, state.free.memory_mb, strict=True
        )
    }
    tasks = Counter(a.node_index for a in state.allocations)
    rows = []
    for node in state.nodes:
        health = _HEALTH.get(node.health, "unknown")
        cpu, mem = free.get(node.index, (0, 0))
        rows.append(
            NodeRow(
                node_id=node.node_id,
                lm_id=state.lm_id,
                gm_id=state.gm_ids[node.partition] if node.partition < len(state.gm_ids) else "",
                state="draining" if health == "alive" and node.node_id in draining else health,
                cpu_free_milli=int(cpu),
                cpu_milli=node.capacity.cpu_milli,
                memory_free_mb=int(mem),
                memory_mb=node.capacity.memory_mb,
                tasks=tasks[node.index],
                constraints=from_mask(node.constraint_mask),
                address=node.worker_address,
            )
        )
    return rows


def render(rows: list[NodeRow], labels: Mapping[int, str] | None = None) -> str:
    """A table a person reads; constraints by the names the federation gives them."""
    header = ("NODE", "LM", "GM", "STATE", "CPU free/total", "MEM free/total", "TASKS")
    lines = [
        (
            r.node_id,
            r.lm_id,
            r.gm_id,
            r.state,
            f"{format_quantity(CPU, r.cpu_free_milli)}/{format_quantity(CPU, r.cpu_milli)}",
            f"{r.memory_free_mb}/{r.memory_mb}Mi",
            str(r.tasks),
            _constraints(r.constraints, labels),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + "  CONSTRAINTS"]
    for line in lines:
        cells = "  ".join(c.ljust(w) for c, w in zip(line[:-1], widths, strict=True))
        out.append(f"{cells}  {line[-1]}".rstrip())
    return "\n".join(out)


def _constraints(ids: list[int], labels: Mapping[int, str] | None) -> str:
    labels = labels or {}
    return ", ".join(labels.get(c, str(c)) for c in ids) or "-"


async def lm_rows(target: str, lm_id: str) -> list[NodeRow]:
    state, draining = await lm_nodes(target)
    return node_rows(state, draining)


async def lm_nodes(target: str) -> tuple[common_pb2.LocalMasterState, set[str]]:
    """An LM's full state, and the ids it holds drained (dead or not registered too)."""
    async with channel(target) as chan:
        stub = local_master_pb2_grpc.LocalMasterStub(chan)
        reply = await stub.GetState(local_master_pb2.GetStateRequest(), timeout=10)
        drained = await stub.DrainNode(local_master_pb2.DrainNodeRequest(query=True), timeout=10)
    return reply.state, set(drained.draining_node_ids)


async def nodes(args: argparse.Namespace, config: FederationConfig) -> int:
    wanted: set[int] = set()
    if args.constraint:
        try:
            mask = parse_constraints(
                args.constraint, config.num_constraints, config.constraint_names
            )
        except ConstraintError as err:
            print(f"megha: {err}", file=sys.stderr)
            return 2
        wanted = set(from_mask(mask))
    rows: list[NodeRow] = []
    failed = False
    for lm in [config.lm(args.lm)] if args.lm else config.lms:
        try:
            rows += await lm_rows(lm.target, lm.id)
        except grpc.aio.AioRpcError as err:
            print(f"megha: {lm.id}: {err.code().name}: {err.details()}", file=sys.stderr)
            failed = True
    if wanted:
        rows = [r for r in rows if wanted <= set(r.constraints)]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    elif rows:
        print(render(rows, config.constraint_labels))
    else:
        print("no node" + (" has those constraints" if args.constraint else ""))
    return 1 if failed else 0
