"""``megha console``: the web console, a Starlette app served by uvicorn.

    browser ──GET /jobs──▶ page (layout + fragment) ──console.js every few s──▶
        GET /jobs?fragment=1 ──▶ Sources.jobs ──gRPC──▶ GMs ──▶ the live region swapped in
    scripts ──GET /api/jobs──▶ the same record as JSON

Read-only: nothing here changes the federation. Routes (each also under ``/api/`` as
JSON, and ``/api/jobs/{job_id}/tasks/{task_id}/output``):

- ``/federation``: LMs, partitions per GM, nodes (alive/dead/draining, free of total),
  heartbeat ages;
- ``/queues``: share, usage, pending, running, limit, preempted tasks per queue;
- ``/jobs?queue=Q&state=S``: jobs newest first, counts by state;
- ``/jobs/{job_id}?task=T&stderr=1``: a job's tasks (state, node, allocation time,
  pending reason), and a task's output;
- ``/allocations``: each GM's recent allocation times, histogram and CDF.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from services.common.config import FederationConfig
from services.console import pages
from services.console.gather import TASK_STATES, NotFound, Sources
from services.console.script import CONSOLE_JS

log = logging.getLogger("megha.console")

DEFAULT_PORT = 8080
REFRESH_S = 2.0  # how often an open page fetches its live region again
MAX_JOBS = 1000


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "50")
    try:
        limit = int(raw)
    except ValueError:
        raise ValueError(f"limit must be a whole number, got {raw!r}") from None
    if not 1 <= limit <= MAX_JOBS:
        raise ValueError(f"limit must be between 1 and {MAX_JOBS}, got {limit}")
    return limit


def build_app(sources: Sources, refresh_s: float = REFRESH_S) -> Starlette:
    """The console over ``sources``; pages renew their live region every ``refresh_s``."""
    every_ms = int(refresh_s * 1000)

    def page(
        title: str,
        current: str,
        get: Callable[[Request], Awaitable],
        render: Callable[..., str],
        above: Callable[[Request], str] | None = None,
    ):
        async def endpoint(request: Request) -> Response:
            api = request.url.path.startswith("/api/")
            try:
                data = await get(request)
            except NotFound as err:
                if api:
                    return JSONResponse({"error": str(err)}, status_code=404)
                return HTMLResponse(_whole(request, title, current, pages.not_found(str(err))), 404)
            except ValueError as err:  # a bad query parameter
                if api:
                    return JSONResponse({"error": str(err)}, status_code=400)
                return HTMLResponse(_whole(request, title, current, pages.not_found(str(err))), 400)
            if api:
                return JSONResponse(data)
            fragment = render(*data) if isinstance(data, tuple) else render(data)
            if request.query_params.get("fragment"):
                return HTMLResponse(fragment)
            head = above(request) if above is not None else ""
            return HTMLResponse(_whole(request, title, current, fragment, head))

        return endpoint

    def _whole(request: Request, title: str, current: str, fragment: str, head: str = "") -> str:
        params = dict(request.query_params)
        params["fragment"] = "1"
        src = request.url.path + "?" + "&".join(f"{k}={_q(v)}" for k, v in params.items())
        return pages.layout(title, current, fragment, src, every_ms, head)

    async def get_jobs(request: Request):
        q = request.query_params
        return await sources.jobs(q.get("queue", ""), q.get("state", ""), _limit(request))

    async def get_job(request: Request):
        job_id = request.path_params["job_id"]
        data = await sources.job(job_id)
        task = request.query_params.get("task", "")
        if request.url.path.startswith("/api/") or not task:
            return data if request.url.path.startswith("/api/") else (data, None, "")
        if task not in {t["task_id"] for t in data["task_list"]}:
            raise NotFound(f"job {job_id!r} has no task {task!r}")
        stderr = bool(request.query_params.get("stderr"))
        return data, await sources.output(job_id, task, stderr), task

    async def get_output(request: Request):
        p = request.path_params
        return await sources.output(
            p["job_id"], p["task_id"], bool(request.query_params.get("stderr"))
        )

    def jobs_form(request: Request) -> str:
        known = [q.name for q in sources.config.effective_queues()]
        q = request.query_params
        return pages.jobs_filter(q.get("queue", ""), q.get("state", ""), known, list(TASK_STATES))

    async def home(_request: Request) -> Response:
        return RedirectResponse("/federation")

    async def script(_request: Request) -> Response:
        return Response(CONSOLE_JS, media_type="text/javascript")

    async def healthz(_request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    federation = page("Federation", "federation", lambda r: sources.federation(), pages.federation)
    queues = page("Queues", "queues", lambda r: sources.queues(), pages.queues)
    jobs = page("Jobs", "jobs", get_jobs, pages.jobs, jobs_form)
    job = page("Job", "jobs", get_job, pages.job)
    allocations = page(
        "Allocation times", "allocations", lambda r: sources.allocations(), pages.allocations
    )
    output = page("Output", "jobs", get_output, str)
    routes = [
        Route("/", home),
        Route("/healthz", healthz),
        Route("/static/console.js", script),
        Route("/federation", federation),
        Route("/queues", queues),
        Route("/jobs", jobs),
        Route("/jobs/{job_id:path}", job),
        Route("/allocations", allocations),
        Route("/api/federation", federation),
        Route("/api/queues", queues),
        Route("/api/jobs", jobs),
        Route("/api/jobs/{job_id}/tasks/{task_id}/output", output),
        Route("/api/jobs/{job_id:path}", job),
        Route("/api/allocations", allocations),
    ]
    return Starlette(routes=routes)


def _q(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process that runs the console (``megha
    up``, ``megha console``) handles Ctrl-C and SIGTERM itself."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int, fallback: bool = False) -> socket.socket:
    """A listening socket on ``host:port``; with ``fallback``, a port the system picks
    when that one is taken (``megha up``: a console on another port beats none)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        if not fallback:
            sock.close()
            raise
        sock.bind((host, 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


@contextlib.asynccontextmanager
async def running_console(
    config: FederationConfig, sock: socket.socket, refresh_s: float = REFRESH_S
) -> AsyncIterator[str]:
    """Serve the console on ``sock`` (see ``bind``) until the block ends; yields its URL."""
    sources = Sources(config)
    server = _Server(
        uvicorn.Config(build_app(sources, refresh_s), log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
                raise RuntimeError("the console stopped as it started")
            await asyncio.sleep(0.01)
        yield url_of(sock)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        await sources.close()
        sock.close()


async def serve(config: FederationConfig, host: str, port: int, refresh_s: float) -> int:
    """``megha console``: serve until Ctrl-C or SIGTERM."""
    import signal

    try:
        sock = bind(host, port)
    except OSError as err:
        print(f"megha: the console cannot listen on {host}:{port}: {err.strerror}", flush=True)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running_console(config, sock, refresh_s) as url:
        print(f"megha: console on {url} (read-only; Ctrl-C stops it)", flush=True)
        await stop.wait()
    return 0
