"""The image's HEALTHCHECK: grpc.health.v1 Check against this container's Megha server.

The role comes from the main process's command line (``megha gm --id gm-1``, ``megha lm
--id lm-1``, ``megha predictor``), its port from the federation file (``--config`` or
MEGHA_CONFIG, with the MEGHA_GMS / MEGHA_LMS / MEGHA_PREDICTOR overrides). The file is read
here with plain YAML/TOML rather than services.common.config: that import costs about a
second of CPU (scipy, through the placement policies), too much for a check every few
seconds in every container. Roles without a gRPC server (worker, one-shot commands) are
healthy while they run. MEGHA_HEALTH_TARGET=HOST:PORT skips the lookup. With the file's
``tls`` (or MEGHA_TLS) the check speaks mutual TLS with the same files.

Exit 0: SERVING; 1: anything else (Docker's contract).
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import yaml

ROLES = ("gm", "lm", "predictor")
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def server_argv() -> list[str] | None:
    """The command line of the oldest process in this container running a Megha server."""
    pids = sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        for i, arg in enumerate(argv):
            if arg.endswith("megha") or arg == "services.cli":
                rest = argv[i + 1 :]
                if rest and rest[0] in ROLES:
                    return rest
                break
    return None


def option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _read(path: str) -> dict:
    text = Path(path).read_text()
    return (tomllib.loads(text) if path.endswith(".toml") else yaml.safe_load(text)) or {}


def tls_of(config: dict) -> dict | None:
    """The federation's ``tls`` (MEGHA_TLS, else the file's), or None: plaintext."""
    override = os.environ.get("MEGHA_TLS")
    if override:
        return yaml.safe_load(override) or None
    return config.get("tls")


def target_of(argv: list[str], path: str | None, config: dict) -> str:
    """The server's address: the role's entry of the federation file ``config``, read
    from ``path``."""
    role = argv[0]
    if not path:
        raise SystemExit("healthcheck: no federation file (--config or MEGHA_CONFIG)")
    key = {"gm": "gms", "lm": "lms", "predictor": "predictor"}[role]
    override = os.environ.get("MEGHA_" + key.upper())
    entry = yaml.safe_load(override) if override else config.get(key)
    if role != "predictor":
        ident = option(argv, "--id")
        entry = next((e for e in entry or [] if e.get("id") == ident), None)
    if not entry:
        raise SystemExit(f"healthcheck: no {role} {option(argv, '--id') or ''} in {path}")
    bind = str(entry.get("bind", ""))
    host = str(entry.get("host", "127.0.0.1"))
    address = host if not bind else "127.0.0.1" if bind in WILDCARDS else bind
    return f"{address}:{entry['port']}"


def _channel(target: str, tls: dict | None):
    import grpc

    options: list[tuple[str, object]] = [("grpc.enable_http_proxy", 0)]
    if not tls:
        return grpc.insecure_channel(target, options=options)
    paths = dict(tls)
    if tls.get("dir"):  # per-process identities: health is open to any of them
        identity = os.environ.get("MEGHA_IDENTITY", "client/shared")
        paths["cert"], paths["key"] = (f"{tls['dir']}/{identity}.{ext}" for ext in ("crt", "key"))
    ca, cert, key = (Path(paths[name]).read_bytes() for name in ("ca", "cert", "key"))
    if tls.get("server_name"):
        options.append(("grpc.ssl_target_name_override", tls["server_name"]))
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(ca, key, cert), options)


def check(target: str, tls: dict | None = None, timeout_s: float = 3.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(target, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError as err:
            print(f"{target}: {err.code().name}", file=sys.stderr)
            return False
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> int:
    target = os.environ.get("MEGHA_HEALTH_TARGET")
    argv = None
    if not target:
        argv = server_argv()
        if argv is None:
            print("no Megha server in this container: healthy while it runs")
            return 0
    path = (option(argv, "--config") if argv else None) or os.environ.get("MEGHA_CONFIG")
    config = _read(path) if path else {}  # read once: the target and the TLS files
    if not target:
        assert argv is not None
        target = target_of(argv, path, config)
    return 0 if check(target, tls_of(config)) else 1


if __name__ == "__main__":
    sys.exit(main())
