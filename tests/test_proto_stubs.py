"""The wire contract: committed stubs match the protos, the stubs work, the protos follow
the buf style the project agreed on (STYLE.md)."""

from __future__ import annotations

import importlib
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "protos" / "megha" / "v1"
STUBS = REPO / "services" / "_proto"
PROTO_FILES = sorted(PROTO_DIR.glob("*.proto"))
STUB_MODULES = sorted(
    f"services._proto.megha.v1.{p.stem}"
    for p in (STUBS / "megha" / "v1").glob("*.py")
    if p.stem.endswith(("_pb2", "_pb2_grpc"))
)

# Repeated fields whose natural name is not a plural ending in "s". FreeColumns'
# columns are named like the Resources fields they hold, so code maps one onto the other.
NON_S_PLURALS = {
    ("FreeColumns", "cpu_milli"),
    ("FreeColumns", "memory_mb"),
    ("FreeColumns", "disk_mb"),
    ("ForecastDemandRequest", "history"),
    ("ForecastDemandResponse", "scale_plan"),
}


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"gen_protos.py failed:\n{result.stdout}{result.stderr}"
    fresh, committed = _tree(tmp_path), _tree(STUBS)
    drifted = sorted(
        name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name)
    )
    assert not drifted, (
        f"services/_proto is stale ({', '.join(drifted)}); run `python scripts/gen_protos.py`"
    )


@pytest.mark.parametrize("module", STUB_MODULES)
def test_stub_imports(module: str) -> None:
    importlib.import_module(module)


def test_stub_modules_cover_every_proto() -> None:
    expected = {f"services._proto.megha.v1.{p.stem}_pb2" for p in PROTO_FILES}
    assert expected <= set(STUB_MODULES)


def test_local_master_state_round_trip() -> None:
    from services._proto.megha.v1 import common_pb2 as pb
    from services._proto.megha.v1 import local_master_pb2_grpc

    assert hasattr(local_master_pb2_grpc, "LocalMasterStub")
    state = pb.LocalMasterState(
        lm_id="lm-0",
        version=7,
        full=True,
        nodes=[
            pb.NodeState(
                node_id="n-3",
                index=3,
                capacity=pb.Resources(cpu_milli=4000, memory_mb=8192),
                constraint_mask=(1 << 63) | 1,
                partition=1,
                health=pb.NODE_HEALTH_ALIVE,
            )
        ],
        free=pb.FreeColumns(indices=[3], cpu_milli=[3000], memory_mb=[4096], disk_mb=[0]),
        allocations=[
            pb.Allocation(
                task_id="t-1",
                queue="alice",
                node_index=3,
                resources=pb.Resources(cpu_milli=1000, memory_mb=4096),
                partition=1,
                logical=True,
                sequence=42,
            )
        ],
        gm_ids=["gm-0", "gm-1"],
    )
    parsed = pb.LocalMasterState.FromString(state.SerializeToString())
    assert parsed == state
    assert parsed.nodes[0].constraint_mask == (1 << 63) | 1  # fixed64 keeps all 64 bits
    assert list(parsed.free.cpu_milli) == [3000]
    assert parsed.allocations[0].logical and parsed.allocations[0].sequence == 42
    # The import rewrite also names the classes' module, which pickling relies on.
    assert pickle.loads(pickle.dumps(parsed)) == state


def _blocks(text: str, keyword: str) -> list[tuple[str, str]]:
    """(name, body) of every top-level or nested `keyword Name { ... }` block."""
    blocks = []
    for match in re.finditer(rf"\b{keyword}\s+(\w+)\s*\{{", text):
        depth, i = 1, match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        blocks.append((match.group(1), text[match.end() : i - 1]))
    return blocks


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


@pytest.mark.parametrize("proto", PROTO_FILES, ids=lambda p: p.name)
def test_proto_style(proto: Path) -> None:
    text = _strip_comments(proto.read_text(encoding="utf-8"))
    assert re.fullmatch(r"[a-z][a-z0-9_]*\.proto", proto.name)
    assert re.search(r"^package megha\.v1;$", text, re.MULTILINE)
    assert "google.protobuf.Empty" not in text

    for enum, body in _blocks(text, "enum"):
        values = re.findall(r"(\w+)\s*=\s*(\d+)\s*;", body)
        prefix = _upper_snake(enum) + "_"
        assert values[0] == (prefix + "UNSPECIFIED", "0"), enum
        assert all(name.startswith(prefix) for name, _ in values), enum

    for message, body in _blocks(text, "message"):
        # Nested messages are checked as their own blocks; drop them from the parent.
        body = re.sub(r"\bmessage\s+\w+\s*\{[^{}]*\}", "", body)
        for field in re.findall(r"(?:[\w.]+|map<[^>]+>)\s+(\w+)\s*=\s*\d+", body):
            assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", field), f"{message}.{field}"
        for field in re.findall(r"\brepeated\s+[\w.]+\s+(\w+)\s*=", body):
            assert field.endswith("s") or (message, field) in NON_S_PLURALS, (
                f"{message}.{field}: repeated fields get plural names"
            )

    for service, body in _blocks(text, "service"):
        for rpc, request, response in re.findall(
            r"rpc\s+(\w+)\s*\(\s*(?:stream\s+)?(\w+)\s*\)\s*returns\s*\(\s*(?:stream\s+)?(\w+)",
            body,
        ):
            # Streams of heartbeats/commands are messages in their own right, not requests.
            if service == "LocalMaster" and rpc == "WorkerHeartbeats":
                continue
            assert (request, response) == (f"{rpc}Request", f"{rpc}Response"), rpc
