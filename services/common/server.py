"""gRPC server set-up every service shares: health, reflection, metrics, graceful stop,
requests checked in the call (``checked_requests.py``)."""

from __future__ import annotations

import functools
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from services.common import authz
from services.common.checked_requests import CheckedRequests

if TYPE_CHECKING:
    from services.common.config import FederationConfig, TlsConfig

log = logging.getLogger("megha.server")

# Heartbeat snapshots of big LMs and batched launches can exceed gRPC's 4 MiB default;
# anything past this is a bug or an attack and gets RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that was down for long is reached again within 2 s of its return (gRPC's
    # default backoff grows to 120 s: after a 40 s LM outage its workers took 26 s).
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Calls that reached gRPC but not yet the server's event loop wait in gRPC's own queue.
# Past ``grpc.server.max_pending_requests`` (default 1,000) gRPC drops them at random,
# and past the hard limit (3,000) all, each as a bare CANCELLED that a client cannot tell
# from its own cancel: of 2,000 SubmitJob calls sent at once, about 10 % were lost so. The
# loop takes each in microseconds, so the queue only fills in a burst; a service that
# cannot keep up says so itself (the GM: RESOURCE_EXHAUSTED, with a hint to retry).
MAX_PENDING_CALLS = 100_000
# Servers accept the clients' keepalive pings (their default policy answers a ping every
# 10 s with GOAWAY "Too many pings", which kills long watch and heartbeat streams).
SERVER_OPTIONS: list[tuple[str, Any]] = [
    *CHANNEL_OPTIONS[:2],
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]
_metrics_ports: set[int] = set()


@dataclass(frozen=True)
class Tls:
    """The federation's mutual TLS material, read from its files once per process."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""
    cert_path: str = ""
    key_path: str = ""
    token: str = ""  # a user's bearer token, shown instead of a certificate

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        if self.token:
            token = grpc.access_token_call_credentials(self.token)
            return grpc.composite_channel_credentials(credentials, token)
        return credentials

    @functools.cached_property
    def broker_context(self) -> ssl.SSLContext:
        """The client side of a TLS connection to RabbitMQ with the same CA and certificate
        (``ssl`` loads a certificate chain only from files, so they are read once more)."""
        context = _NamedContext(ssl.PROTOCOL_TLS_CLIENT)
        context.server_name = self.server_name
        context.load_verify_locations(cadata=self.ca.decode())
        context.load_cert_chain(self.cert_path, self.key_path)
        return context


class _NamedContext(ssl.SSLContext):
    """Checks ``server_name`` in the server's certificate instead of the host connected
    to, when set: aio-pika passes no ``server_hostname`` of its own."""

    server_name = ""

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        name = self.server_name or server_hostname
        return super().wrap_bio(incoming, outgoing, server_side, name, session)


_tls: Tls | None = None  # set by use_tls: every server and channel of the process then


class TlsError(ValueError):
    """A TLS file of the federation file that cannot be read (named in the message)."""


DEFAULT_IDENTITY = "admin/operator"  # who the CLI is, with per-process identities
# What a user with a token ($MEGHA_TOKEN) shows: a certificate that lets a client connect
# (the servers ask every caller for one) but names no one; the token names the user.
TOKEN_IDENTITY = "client/shared"


def identity_files(config: TlsConfig, identity: str | None = None) -> tuple[str, str]:
    """The certificate and key this process shows: ``config``'s one pair, or with
    per-process identities (``dir``) ``<dir>/<identity>.crt`` and ``.key``. ``identity``
    is ``role/name``; None: ``$MEGHA_IDENTITY``, else ``admin/operator`` (the CLI), or
    with ``$MEGHA_TOKEN`` (a user's bearer token, sent with each call) ``client/shared``."""
    if not config.dir:
        return config.cert, config.key
    identity = identity or os.environ.get("MEGHA_IDENTITY") or DEFAULT_IDENTITY
    base = Path(config.dir) / identity
    return f"{base}.crt", f"{base}.key"


def use_tls(config: TlsConfig | None, identity: str | None = None) -> None:
    """Make every ``Service`` and ``channel`` of this process speak mutual TLS with the
    files ``config`` names (None: plaintext, the default), showing ``identity``'s
    certificate (``identity_files``). Call it once at start-up, before any server or
    channel is made."""
    global _tls
    if config is None:
        _tls = None
        return
    token = os.environ.get("MEGHA_TOKEN", "") if identity is None else ""
    if token and not os.environ.get("MEGHA_IDENTITY"):
        identity = TOKEN_IDENTITY
    cert, key = identity_files(config, identity)
    paths = {"ca": config.ca, "cert": cert, "key": key}
    files = {}
    for name in ("ca", "cert", "key"):
        path = paths[name]
        try:
            files[name] = Path(path).read_bytes()
        except OSError as err:
            raise TlsError(f"tls.{name}: cannot read {path}: {err.strerror or err}") from None
        if b"-----BEGIN " not in files[name]:
            raise TlsError(f"tls.{name}: {path} is not a PEM file")
    _tls = Tls(files["ca"], files["cert"], files["key"], config.server_name, cert, key, token)


# aiormq's own TLS settings in a broker URL's query; a URL with any of them keeps them.
_URL_TLS_KEYS = frozenset({"cafile", "capath", "cadata", "certfile", "keyfile", "no_verify_ssl"})


def broker_ssl_context(url: str) -> ssl.SSLContext | None:
    """The TLS context for the RabbitMQ connection to ``url``. An ``amqps://`` URL uses
    the federation's CA and certificate once ``use_tls`` was given them, unless its query
    names its own (aiormq's ``cafile``, ``certfile``, ``keyfile``, ...); None leaves it to
    aiormq (a plain ``amqp://`` URL, or no federation TLS: the system's CAs)."""
    parts = urlsplit(url)
    if _tls is None or parts.scheme != "amqps" or _URL_TLS_KEYS & parse_qs(parts.query).keys():
        return None
    return _tls.broker_context


def warn_if_broker_plaintext(url: str) -> None:
    """Say so when gRPC is on TLS but the broker URL is plain AMQP (only the gRPC
    connections are then encrypted)."""
    if _tls is not None and urlsplit(url).scheme == "amqp":
        log.warning(
            "tls is set but rabbitmq_url is amqp://: heartbeats, events and queued jobs "
            "cross the network in plaintext (use amqps://)"
        )


Registrar = Callable[[Any, grpc.aio.Server], None]


class Service:
    """One gRPC server: ``async with Service(...)`` serves until the block ends.

    ``stop`` is idempotent: health turns NOT_SERVING first (so load balancers and
    ``megha up`` stop routing), then in-flight calls get ``grace_s`` to finish.
    """

    def __init__(
        self,
        listen: str,
        servicers: Sequence[tuple[Registrar, Any, str]],
        metrics_port: int = 0,
        grace_s: float = 2.0,
    ):
        self.listen = listen
        self.servicers = servicers
        self.metrics_port = metrics_port
        self.grace_s = grace_s
        self.server: grpc.aio.Server | None = None
        self.health = health_aio.HealthServicer()
        self.port = 0

    async def start(self) -> Service:
        # Requests are parsed in the call, so that bad bytes are INVALID_ARGUMENT.
        # With authorization on, a caller's identity is checked per call.
        jobs = next((s.job_access for _, s, _ in self.servicers if hasattr(s, "job_access")), None)
        checks = authz.authorizer(jobs)
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[CheckedRequests(checks)])
        names = [
            reflection.SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ]
        for register, servicer, full_name in self.servicers:
            register(servicer, server)
            names.append(full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(names, server)
        if _tls is None:
            self.port = server.add_insecure_port(self.listen)
        else:
            self.port = server.add_secure_port(self.listen, _tls.server_credentials())
        if self.port == 0:
            raise OSError(f"cannot listen on {self.listen} (address in use?)")
        await server.start()
        self.server = server
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        for _, _, full_name in self.servicers:
            await self.health.set(full_name, serving)
        start_metrics(self.metrics_port)
        log.info("serving", extra={"listen": self.listen, "services": names[2:]})
        return self

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        await self.health.enter_graceful_shutdown()
        await server.stop(self.grace_s)

    async def wait(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()

    async def __aenter__(self) -> Service:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def start_metrics(port: int) -> None:
    """Serve Prometheus metrics on ``port`` (0 = none). Several services in one process
    (``megha up --embedded``) share one registry, so each port is opened once."""
    if port and port not in _metrics_ports:
        start_http_server(port, addr="0.0.0.0")
        _metrics_ports.add(port)


def channel(target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A client channel with the same message limits and keepalives as the servers (and
    ``options`` besides), over mutual TLS once ``use_tls`` was given the files."""
    options = [*CHANNEL_OPTIONS, *options]
    if _tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    if _tls.server_name:
        options.append(("grpc.ssl_target_name_override", _tls.server_name))
    return grpc.aio.secure_channel(target, _tls.channel_credentials(), options=options)


async def wait_healthy(target: str, timeout_s: float = 10.0, service: str = "") -> None:
    """Poll the gRPC health protocol until SERVING; raise TimeoutError with the target."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{target} did not become healthy within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)


def endpoints(config: FederationConfig) -> list[tuple[str, str]]:
    """Every gRPC server of ``config`` that answers health checks, named: GMs, LMs, the
    predictor."""
    out = [(f"GM {g.id}", g.target) for g in config.gms]
    out += [(f"LM {m.id}", m.target) for m in config.lms]
    if config.predictor is not None:
        out.append(("predictor", config.predictor.target))
    return out


async def wait_all_healthy(config: FederationConfig, timeout_s: float = 30.0) -> None:
    """``wait_healthy`` for every one of ``endpoints(config)`` at once."""
    import asyncio

    await asyncio.gather(*(wait_healthy(t, timeout_s) for _, t in endpoints(config)))
