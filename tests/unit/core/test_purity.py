"""DESIGN.md: every decision lives in services/core, which does no I/O, reads no clock
and imports nothing of ours outside itself. Checked on the source, so a stray import
fails here before it spreads."""

import ast
from pathlib import Path

import services.core

CORE = Path(services.core.__file__).parent
FORBIDDEN_MODULES = {
    "asyncio", "socket", "time", "datetime", "random", "threading", "subprocess",
    "grpc", "aio_pika", "os", "requests", "urllib",
}  # fmt: skip
ALLOWED_OUR_PACKAGES = ("services.core",)


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_has_no_io_clocks_or_outward_imports():
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for module in imported_modules(path):
            top = module.split(".")[0]
            ours = top in ("services", "loadgen")
            if top in FORBIDDEN_MODULES or (ours and not module.startswith(ALLOWED_OUR_PACKAGES)):
                offenders.append(f"{path.name}: {module}")
    assert not offenders, "services/core must stay pure: " + ", ".join(offenders)
