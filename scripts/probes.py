"""Failure probes against a private federation (the integration tests' harness): each
starts one, does something unkind to it, and prints what became of the tasks.

Run from the repository root, with RabbitMQ up:

    python scripts/probes.py unreachable-lm [--tasks 160] [--no-drop]
        the GM cannot reach lm-1 (iptables DROP; root only) while lm-1's heartbeats still
        arrive through RabbitMQ: how long do tasks wait, and where do they run?
    python scripts/probes.py frozen-gm [--seconds 15]
        gm-1 stopped (SIGSTOP) while its queue holds more than fits, then resumed
    python scripts/probes.py frozen-broker [--seconds 15]
        RabbitMQ's beam.smp stopped, then resumed (it stops the broker for everyone)
    python scripts/probes.py big-job [--tasks 100000]
        one job of many 1 ms tasks: how late the GM's loop ran while it took the job,
        throughput, memory of each process, GetJob's size
    python scripts/probes.py whole-crash [--tasks 400] [--after 3] [--times 1] [--kill NAMES]
        every process (or those named, e.g. lm-lm-1,gm-gm-1) killed (-9) at once while
        tasks queue, start, run and end, then restarted (RabbitMQ stays up): is every
        task run, and how many twice?
    python scripts/probes.py cancel [--tasks 20000]
        a job that fills every worker and queues the rest, cancelled through the GM that
        does not serve its queue: how long until every task ended CANCELLED, and until
        the next job runs in its room?
    python scripts/probes.py idle-worker [--agents 100] [--interval 0.05] [--seconds 60]
                                         [--stream-life 120]
        a worker host whose agents only heartbeat (no task): does its memory level off?
    python scripts/probes.py slow-watchers [--tasks 20000] [--watchers 20]
        watches of one big job that read the first event and no more: how much does the
        GM keep for them (its peak RSS against the same job watched by none), and how
        does each watch end?
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness is in tests/

from services._proto.megha.v1 import common_pb2, global_master_pb2, global_master_pb2_grpc
from services.common.config import WORKER_STREAM_LIFE_S
from services.common.server import channel
from tests.integration.harness import Federation, sim_tasks

RUNNING, SUCCEEDED = common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_SUCCEEDED
DETOUR = "127.0.0.3"  # the address the GM dials lm-1 at in unreachable-lm


def _federation(name: str, **kwargs) -> Federation:
    return Federation(Path(tempfile.mkdtemp(prefix=f"probe-{name}-")), **kwargs)


async def _all_succeeded(fed: Federation, job_id: str, tasks: int, timeout_s: float) -> bool:
    """Every GM's ``GetJob`` shows all ``tasks`` SUCCEEDED (what users see), within the
    time; a GM that does not answer yet (restarting) is asked again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            jobs = [await fed.gm(gm.id).job(job_id) for gm in fed.config.gms]
        except grpc.aio.AioRpcError:
            jobs = []
        if jobs and all(
            len(job.tasks) == tasks and all(t.state == SUCCEEDED for t in job.tasks) for job in jobs
        ):
            return True
        await asyncio.sleep(0.2)
    return False


async def _report(fed: Federation, ids: set[str], job_id: str) -> float:
    """Did every task succeed once, and do both GMs and the books agree? Success is
    what the GMs' books say; the broker's event stream is counted apart (an LM that
    dies between journalling an ending and publishing it leaves it out of the stream,
    and the GMs learn it with LookupTasks). Returns how long it waited for success."""
    began = time.monotonic()
    if not await _all_succeeded(fed, job_id, len(ids), timeout_s=120):
        print("  NOT ALL SUCCEEDED in every GM's GetJob within 120 s")
    waited = time.monotonic() - began
    await asyncio.sleep(3)
    runs = Counter((e.task_id, e.attempt) for e in fed.events.events if e.state == RUNNING)
    succeeded = Counter(e.task_id for e in fed.events.events if e.state == SUCCEEDED)
    print(f"  tasks {len(ids)}, succeeded in the event stream {len(succeeded)}")
    print(
        f"  most runs of one attempt {max(runs.values(), default=0)}, "
        f"most successes of one task {max(succeeded.values(), default=0)}"
    )
    for gm in fed.config.gms:
        job = await fed.gm(gm.id).job(job_id)
        states = Counter(common_pb2.TaskState.Name(t.state) for t in job.tasks)
        print(f"  {gm.id} GetJob: {dict(states)}")
    for name in fed.children.procs:
        lines = fed.log(name).splitlines()
        warned = [line for line in lines if '"warning"' in line or '"error"' in line]
        print(f"  {name}: {len(warned)} warnings or errors")
    await fed.assert_books_balanced()
    print("  books balanced")
    return waited


async def frozen_gm(seconds: float) -> None:
    async with _federation("frozen-gm", gms=2, lms=2, workers_per_lm=2) as fed:
        reply = await fed.gm("gm-1").submit(sim_tasks(40, 1.0, cpu_milli=2000))
        await asyncio.sleep(0.5)
        gm = fed.children.procs["gm-gm-1"]
        gm.send_signal(signal.SIGSTOP)
        try:
            other = await fed.gm("gm-2").submit(sim_tasks(8, 0.5))
            await asyncio.sleep(seconds)
        finally:
            gm.send_signal(signal.SIGCONT)
        print(f"gm-1 stopped for {seconds:g} s")
        await _report(fed, set(reply.task_ids) | set(other.task_ids), reply.job_id)


async def frozen_broker(seconds: float) -> None:
    found = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True)
    beam = int(found.stdout.split()[0])
    async with _federation("frozen-broker", gms=2, lms=2, workers_per_lm=2) as fed:
        reply = await fed.gm("gm-1").submit(sim_tasks(40, 1.0, cpu_milli=2000))
        await asyncio.sleep(0.5)
        os.kill(beam, signal.SIGSTOP)
        began = time.monotonic()
        try:
            try:
                late = await asyncio.wait_for(fed.gm("gm-2").submit(sim_tasks(8, 0.5)), 5)
                print(f"  a submission while stopped: accepted, {len(late.task_ids)} tasks")
            except Exception as err:  # TimeoutError, or the GM's own answer
                late = None
                print(f"  a submission while stopped: {type(err).__name__}")
            await asyncio.sleep(max(0.0, seconds - (time.monotonic() - began)))
        finally:
            os.kill(beam, signal.SIGCONT)
        print(f"RabbitMQ stopped for {seconds:g} s")
        ids = set(reply.task_ids) | (set(late.task_ids) if late else set())
        await _report(fed, ids, reply.job_id)


async def unreachable_lm(drop: bool, tasks: int) -> None:
    async with _federation("unreachable", gms=1, lms=2, workers_per_lm=4) as fed:
        port = fed.config.lm("lm-1").port
        data = yaml.safe_load(fed.config_path.read_text())
        for lm in data["lms"]:
            if lm["id"] == "lm-1":
                lm["host"], lm["bind"] = DETOUR, "0.0.0.0"
        detour = fed.dir / "detour.yaml"
        detour.write_text(yaml.safe_dump(data))
        # lm-1 listens on every address, the GM dials the detour, the workers 127.0.0.1.
        for name in ("lm-lm-1", "gm-gm-1"):
            argv = [
                str(detour) if a == str(fed.config_path) else a for a in fed.children.argv[name]
            ]
            fed.children.kill(name)
            fed.children.start(name, argv)
        await asyncio.sleep(4)
        rule = ["OUTPUT", "-d", DETOUR, "-p", "tcp", "--dport", str(port), "-j", "DROP"]
        if drop:
            subprocess.run(["iptables", "-I", *rule], check=True)
        try:
            for _ in range(100):
                try:
                    await fed.gm().cluster()
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            await asyncio.sleep(2)
            began = time.monotonic()
            ids: set[str] = set()
            for _ in range(10):
                reply = await fed.gm().submit(sim_tasks(tasks // 10, 0.2))
                ids |= set(reply.task_ids)
                await asyncio.sleep(1.0)
            await fed.events.wait_succeeded(ids, timeout_s=120)
            took = time.monotonic() - began
        finally:
            if drop:
                subprocess.run(["iptables", "-D", *rule], check=True)
        ended = [e for e in fed.events.events if e.state == SUCCEEDED and e.task_id in ids]
        spans = sorted(
            (e.timestamps.finished_unix_nanos - e.timestamps.submitted_unix_nanos) / 1e9
            for e in ended
        )
        print(f"lm-1 unreachable from the GM: {drop}")
        print(f"  {len(ids)} tasks in {took:.1f} s, by LM {dict(Counter(e.lm_id for e in ended))}")
        print(
            f"  submit to finish: p50 {spans[len(spans) // 2]:.2f} s, max {spans[-1]:.2f} s, "
            f"{sum(s > 2 for s in spans)} over 2 s"
        )
        print(f"  GM launches that failed: {fed.log('gm-gm-1').count('launch failed')}")


async def big_job(tasks: int) -> None:
    async with _federation(
        "big-job", gms=1, lms=2, workers_per_lm=16, capacity="cpu=16,mem=32Gi"
    ) as fed:
        began = time.monotonic()
        reply = await fed.gm().submit(sim_tasks(tasks, 0.001, cpu_milli=500))
        print(f"{tasks} tasks submitted in {time.monotonic() - began:.1f} s")
        await asyncio.sleep(1.0)  # the GM's stall watcher logs a late loop once it runs
        lags = [
            float(m) for m in re.findall(r"event loop ran ([0-9.]+) s late", fed.log("gm-gm-1"))
        ]
        print(
            f"  the GM's loop while it took the job: {len(lags)} turns 0.1 s late or more, "
            f"the latest {max(lags, default=0):.2f} s"
        )
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=900)
        took = time.monotonic() - began
        print(f"  all succeeded in {took:.1f} s ({tasks / took:.0f} tasks/s)")
        for name, proc in fed.children.procs.items():
            status = Path(f"/proc/{proc.pid}/status").read_text()
            rss_mb = int(status.split("VmRSS:")[1].split()[0]) // 1024
            print(f"  {name}: RSS {rss_mb} MB")
        began = time.monotonic()
        job = await fed.gm().job(reply.job_id)
        print(
            f"  GetJob: {len(job.tasks)} tasks, {job.ByteSize() / 1e6:.1f} MB, "
            f"{time.monotonic() - began:.2f} s"
        )


async def cancel(tasks: int) -> None:
    async with _federation(
        "cancel", gms=2, lms=2, workers_per_lm=16, capacity="cpu=16,mem=32Gi"
    ) as fed:
        slots = 2 * 16 * 16
        reply = await fed.gm("gm-1").submit(sim_tasks(tasks, 600.0))
        ids = set(reply.task_ids)
        deadline = time.monotonic() + 120
        while len(fed.events.nodes_of(RUNNING)) < min(slots, tasks):
            assert time.monotonic() < deadline, "the job never filled the workers"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)
        running = set(fed.events.nodes_of(RUNNING))
        print(f"{tasks} tasks of 600 s: {len(running)} running, the rest queued at gm-1")
        began = time.monotonic()
        answer = await fed.gm("gm-2").cancel(reply.job_id, "probe")
        answered = time.monotonic() - began
        print(
            f"  CancelJob through gm-2 answered in {answered * 1e3:.1f} ms "
            f"(known {answer.known}, {answer.unfinished} not ended)"
        )
        cancelled = common_pb2.TASK_STATE_CANCELLED
        seen = {"running task": None, "task": None}
        while time.monotonic() - began < 120:
            ended = set(fed.events.states(cancelled))
            now = time.monotonic() - began
            if seen["running task"] is None and running <= ended:
                seen["running task"] = now
            if ended >= ids:
                seen["task"] = now
                break
            await asyncio.sleep(0.01)
        for what, when in seen.items():
            shown = "never (120 s)" if when is None else f"{when:.2f} s"
            print(f"  every {what}'s CANCELLED event seen after {shown}")
        after = sum(
            e.state == RUNNING and e.task_id in ids and e.task_id not in running
            for e in fed.events.events
        )
        print(f"  tasks of the job that started after the cancel: {after}")
        for gm in fed.config.gms:
            job = await fed.gm(gm.id).job(reply.job_id)
            counts = Counter(common_pb2.TaskState.Name(t.state) for t in job.tasks)
            print(f"  {gm.id} GetJob: {dict(counts)}")
        began = time.monotonic()
        nxt = await fed.gm("gm-1").submit(sim_tasks(slots, 0.5))
        await fed.events.wait_succeeded(set(nxt.task_ids), timeout_s=60)
        took = time.monotonic() - began
        print(f"  the next job, {slots} tasks of 0.5 s, all ran in {took:.2f} s")


async def whole_crash(tasks: int, after: float, times: int, kill: list[str]) -> None:
    async with _federation("whole-crash", gms=2, lms=2, workers_per_lm=4) as fed:
        reply = await fed.gm("gm-1").submit(sim_tasks(tasks, 0.5))
        ids = set(reply.task_ids)
        for _ in range(times):
            await asyncio.sleep(after)
            counts = Counter(e.state for e in fed.events.events)
            names = kill or sorted(fed.children.procs)
            print(
                f"killing {', '.join(names)}: {counts[RUNNING]} starts and "
                f"{counts[SUCCEEDED]} successes seen of {tasks} tasks"
            )
            fed.children.crash(names)
        waited = await _report(fed, ids, reply.job_id)
        lost = sum(e.state == common_pb2.TASK_STATE_LOST for e in fed.events.events)
        again = fed.events.runs()
        print(
            f"  all succeeded {waited:.1f} s after the last restart; {lost} LOST "
            f"events, {sum(n > 1 for n in again.values())} tasks started more than once"
        )


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


async def idle_worker(agents: int, interval_s: float, seconds: float, life_s: float) -> None:
    async with _federation(
        "idle-worker",
        gms=1,
        lms=1,
        workers_per_lm=agents,
        worker_heartbeat_interval_s=interval_s,
        worker_timeout_s=max(1.5, 20 * interval_s),
        worker_stream_life_s=life_s,
    ) as fed:
        host = fed.children.procs["workers-lm-1"].pid
        lm = fed.children.procs["lm-lm-1"].pid
        await asyncio.sleep(5)  # registered, streams open, allocator warm
        began, first = time.monotonic(), (_rss_mb(host), _rss_mb(lm))
        print(
            f"{agents} agents heartbeating every {interval_s:g} s, no task, "
            f"streams replaced every {life_s:g} s or so"
        )
        while (elapsed := time.monotonic() - began) < seconds:
            await asyncio.sleep(min(10.0, seconds - elapsed))
            elapsed = time.monotonic() - began
            beats = agents * elapsed / interval_s
            host_mb, lm_mb = _rss_mb(host), _rss_mb(lm)
            print(
                f"  {elapsed:5.0f} s: worker host {host_mb:.1f} MB "
                f"({1e6 * (host_mb - first[0]) / beats:+.0f} B per heartbeat), "
                f"LM {lm_mb:.1f} MB ({1e6 * (lm_mb - first[1]) / beats:+.0f} B)"
            )


async def slow_watchers(tasks: int, watchers: int) -> None:
    peaks = []
    for watching in (0, watchers):
        async with _federation(
            "slow-watchers", gms=1, lms=1, workers_per_lm=4, capacity="cpu=64,mem=64Gi"
        ) as fed:
            gm = fed.children.procs["gm-gm-1"].pid
            reply = await fed.gm().submit(sim_tasks(tasks, 0.01, cpu_milli=100))
            async with channel(fed.config.gm("gm-1").target) as ch:
                stub = global_master_pb2_grpc.GlobalMasterStub(ch)
                request = global_master_pb2.WatchJobRequest(job_id=reply.job_id)
                calls = [stub.WatchJob(request) for _ in range(watching)]
                for call in calls:
                    await call.read()  # the watch is on; nothing more is read
                peak = _rss_mb(gm)
                done = asyncio.ensure_future(
                    fed.events.wait_succeeded(set(reply.task_ids), timeout_s=600)
                )
                while not done.done():
                    await asyncio.sleep(0.2)
                    peak = max(peak, _rss_mb(gm))
                await done
                ends: Counter[str] = Counter()
                for call in calls:  # now read each to its end
                    try:
                        while await call.read() is not grpc.aio.EOF:
                            pass
                        ends["read to the end"] += 1
                    except grpc.aio.AioRpcError as err:
                        ends[err.code().name] += 1
            peaks.append(peak)
            print(
                f"{tasks} tasks, {watching} watches that stop reading: GM peak RSS "
                f"{peak:.0f} MB; the watches ended {dict(ends) or '-'}"
            )
    print(f"  kept for the slow watches: {peaks[1] - peaks[0]:+.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    unreachable = probes.add_parser("unreachable-lm")
    unreachable.add_argument("--tasks", type=int, default=160)
    unreachable.add_argument("--no-drop", action="store_true", help="leave lm-1 reachable")
    for name in ("frozen-gm", "frozen-broker"):
        probes.add_parser(name).add_argument("--seconds", type=float, default=15.0)
    probes.add_parser("big-job").add_argument("--tasks", type=int, default=100_000)
    crash = probes.add_parser("whole-crash")
    crash.add_argument("--tasks", type=int, default=400)
    crash.add_argument("--after", type=float, default=3.0, help="seconds before each kill")
    crash.add_argument("--times", type=int, default=1, help="kills, each after --after s")
    crash.add_argument(
        "--kill", default="", help="comma-separated children to kill (default: every one)"
    )
    probes.add_parser("cancel").add_argument("--tasks", type=int, default=20_000)
    idle = probes.add_parser("idle-worker")
    idle.add_argument("--agents", type=int, default=100)
    idle.add_argument("--interval", type=float, default=0.05, help="heartbeat interval, s")
    idle.add_argument("--seconds", type=float, default=60.0)
    idle.add_argument(
        "--stream-life", type=float, default=WORKER_STREAM_LIFE_S, help="worker_stream_life_s"
    )
    slow = probes.add_parser("slow-watchers")
    slow.add_argument("--tasks", type=int, default=20_000)
    slow.add_argument("--watchers", type=int, default=20)
    args = parser.parse_args()
    if args.probe == "unreachable-lm":
        asyncio.run(unreachable_lm(not args.no_drop, args.tasks))
    elif args.probe == "frozen-gm":
        asyncio.run(frozen_gm(args.seconds))
    elif args.probe == "frozen-broker":
        asyncio.run(frozen_broker(args.seconds))
    elif args.probe == "whole-crash":
        kill = [name for name in args.kill.split(",") if name]
        asyncio.run(whole_crash(args.tasks, args.after, args.times, kill))
    elif args.probe == "cancel":
        asyncio.run(cancel(args.tasks))
    elif args.probe == "idle-worker":
        asyncio.run(idle_worker(args.agents, args.interval, args.seconds, args.stream_life))
    elif args.probe == "slow-watchers":
        asyncio.run(slow_watchers(args.tasks, args.watchers))
    else:
        asyncio.run(big_job(args.tasks))


if __name__ == "__main__":
    main()
