"""``megha up`` and the client commands, run the way a newcomer runs them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.integration.harness import Federation, free_port_base, free_ports

pytestmark = pytest.mark.integration

MEGHA = [sys.executable, "-m", "services.cli"]


def small_trace(tmp_path):
    path = tmp_path / "tiny.tr"
    # arrival num_tasks mean durations...; one malformed line is reported, not fatal
    path.write_text("0.0 3 10 10 10 10\n5.0 2 20 20 20\nthis line is broken\n9.0 4 5 5 5 5 5\n")
    return path


def _stop(up: subprocess.Popen) -> None:
    """End a ``megha up`` a failed test left running, with its children (SIGTERM stops
    them; a SIGKILL would leave them behind)."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()


def _pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _wait_for(what: str, probe, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (found := probe()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


def test_embedded_up_replays_a_trace_and_prints_allocation_times(tmp_path):
    base = free_port_base()
    out = subprocess.run(
        [*MEGHA, "up", "--embedded", "--base-port", str(base), "--gms", "1", "--lms", "2",
         "--workers", "2", "--replay", str(small_trace(tmp_path)), "--speedup", "100",
         "--out", str(tmp_path / "report")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "federation up (embedded): 1 GMs, 2 LMs, 4 workers" in out.stdout
    assert "3 jobs at speedup 100" in out.stdout
    assert "completed / offered    9 / 9" in out.stdout
    assert "skipped trace lines    1 malformed" in out.stdout
    assert "allocation time (ms)   p50" in out.stdout
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["target"] == "live" and summary["completed"] == summary["tasks"] == 9


def test_up_runs_processes_and_stops_them_all_on_sigterm(tmp_path):
    base = free_port_base()
    proc = subprocess.Popen(
        [*MEGHA, "up", "--base-port", str(base), "--gms", "1", "--lms", "1", "--workers", "2",
         "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "predictor" in line:
                break
        assert any("federation up (processes" in line for line in lines), proc.stderr.read()
        children = subprocess.run(
            ["pgrep", "-f", "--", f"--config {tmp_path}/federation.yaml"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(children) == 4  # lm, predictor, gm, workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)
    finally:
        _stop(proc)


def test_up_restarts_a_child_that_dies_and_gives_up_on_a_crash_loop(tmp_path):
    base = free_port_base()
    errors = tmp_path / "up.err"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            [*MEGHA, "up", "--base-port", str(base), "--gms", "1", "--lms", "1",
             "--workers", "2", "--log-dir", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    try:
        _wait_for("federation up", lambda: "predictor" in proc.stdout.readline(), 60)
        config = yaml.safe_load((tmp_path / "federation.yaml").read_text())
        env = {**os.environ, "MEGHA_GM": f"127.0.0.1:{config['gms'][0]['port']}"}
        lm = f"lm --id lm-1 --config {tmp_path}/federation.yaml"
        (first,) = _pids(lm)
        os.kill(first, signal.SIGKILL)  # a crash: the LM comes back, and so does the work
        _wait_for(
            "restart said",
            lambda: "lm-lm-1 exited with -9; restarting it" in errors.read_text(),
            10,
        )
        _wait_for("a new LM", lambda: [p for p in _pids(lm) if p != first], 10)
        submit = subprocess.run(
            [*MEGHA, "submit", "--count", "3", "--duration", "0.1", "--wait"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert submit.returncode == 0 and submit.stdout.count("succeeded") == 3, submit.stderr
        assert proc.poll() is None
        # An LM that keeps dying is a crash loop: up stops everything and says why.
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in _pids(lm):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        assert proc.wait(30) == 1
        assert "lm-lm-1 exited with -9, restarted 5 times in 60 s already" in errors.read_text()
        assert _pids(f"--config {tmp_path}/federation.yaml") == []
    finally:
        _stop(proc)


async def test_cli_submit_job_and_status(tmp_path):
    async with Federation(tmp_path, gms=1, lms=2, workers_per_lm=2) as fed:
        env = {**os.environ, "MEGHA_GM": fed.config.gm("gm-1").target}
        submit = subprocess.run(
            [*MEGHA, "submit", "--count", "3", "--resources", "cpu=500m,mem=256Mi",
             "--duration", "0.1", "--wait"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert submit.returncode == 0, submit.stderr
        first = submit.stdout.splitlines()[0]
        assert "3 tasks queued (cpu=500m mem=256Mi" in first
        job_id = first.split()[1].rstrip(":")
        assert submit.stdout.count("succeeded") == 3

        shown = subprocess.run(
            [*MEGHA, "job", job_id], capture_output=True, text=True, timeout=30, env=env
        )
        assert shown.returncode == 0
        assert shown.stdout.splitlines()[0] == f"job {job_id} (queue default): 3 tasks: 3 succeeded"
        assert shown.stdout.count(" succeeded ") == 3  # one row per task

        # A job named on the command line can be submitted again without running twice.
        named = [*MEGHA, "submit", "--count", "2", "--duration", "0.1", "--job-id", "nightly"]
        for _ in range(2):
            again = subprocess.run(
                [*named, "--wait"], capture_output=True, text=True, timeout=60, env=env
            )
            assert again.returncode == 0, again.stderr
            assert again.stdout.startswith("job nightly: 2 tasks queued")
            assert again.stdout.count("succeeded") == 2
        shown = subprocess.run(
            [*MEGHA, "job", "nightly"], capture_output=True, text=True, timeout=30, env=env
        )
        assert shown.stdout.splitlines()[0] == "job nightly (queue default): 2 tasks: 2 succeeded"

        status = subprocess.run(
            [*MEGHA, "status"], capture_output=True, text=True, timeout=30, env=env
        )
        assert status.returncode == 0
        assert "lm-1" in status.stdout and "lm-2" in status.stdout
        assert "allocation time (last 5 tasks of this GM)" in status.stdout

        bad = subprocess.run(
            [*MEGHA, "submit", "--resources", "gpu=1"], capture_output=True, text=True,
            timeout=30, env=env,
        )  # fmt: skip
        assert bad.returncode == 2 and "unknown resource 'gpu'" in bad.stderr
        never = subprocess.run(
            [*MEGHA, "submit", "--resources", "cpu=64"], capture_output=True, text=True,
            timeout=30, env=env,
        )  # fmt: skip
        assert never.returncode == 1 and "FAILED_PRECONDITION" in never.stderr


def test_a_gm_that_answers_unavailable_is_not_called_missing(tmp_path):
    """UNAVAILABLE from a running GM (here: no LM heard from yet) is its own reason; the
    hint to start a federation is only for a GM that does not answer at all. Such an
    answer is asked again for --retry-for seconds, under one job id, saying so."""
    gm_port, lm_port = free_ports(2)
    config = tmp_path / "federation.yaml"
    config.write_text(
        f"gms: [{{id: gm-1, port: {gm_port}}}]\n"
        f"lms: [{{id: lm-1, port: {lm_port}}}]\n"
        f"exchange_prefix: lonely-{gm_port}\n"
    )
    gm = subprocess.Popen(
        [*MEGHA, "gm", "--id", "gm-1", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            submit = subprocess.run(
                [*MEGHA, "submit", "--config", str(config), "--retry-for", "1"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if "failed to connect" not in submit.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # the GM is still starting
        assert submit.returncode == 1
        assert "UNAVAILABLE: no Local Master heard from yet" in submit.stderr
        assert "no Global Master answers" not in submit.stderr
        tries = [line for line in submit.stderr.splitlines() if "trying again" in line]
        assert len(tries) >= 2, submit.stderr  # 0.1 s, 0.2 s, ... within the second
        assert len({line.split("under job id ")[1].split()[0] for line in tries}) == 1
    finally:
        gm.terminate()
        gm.wait(10)
