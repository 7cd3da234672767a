"""Screenshots of every console page, for the README: docs/img/console/*.png.

    python scripts/console_screenshots.py [--out docs/img/console]

Starts ``megha up --embedded`` (1 GM, 2 LMs of 2 workers), submits a few jobs (quick ones
that succeed, a process task that prints, four long ones that fill every node and one
that must wait), then opens each page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium) and saves it. The helpers here (``UpEmbedded``,
``headless_chromium``) also serve the browser tests (tests/console/test_browser.py).
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services._proto.megha.v1 import common_pb2  # noqa: E402
from services.common.client import GlobalMasterClient  # noqa: E402

PAGES = ("federation", "queues", "jobs", "job", "allocations")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UpEmbedded:
    """``megha up --embedded`` as a child process, until the block ends: ``gm`` is the
    GM's target, ``console`` the console's URL, both read from what it prints."""

    def __init__(self, gms: int = 1, lms: int = 2, workers: int = 2, timeout_s: float = 60):
        self.argv = [
            sys.executable, "-m", "services.cli", "up", "--embedded",
            "--gms", str(gms), "--lms", str(lms), "--workers", str(workers),
            "--base-port", str(free_port()), "--console-port", str(free_port()),
        ]  # fmt: skip
        self.timeout_s = timeout_s
        self.gm = self.console = ""
        self.printed: list[str] = []

    def __enter__(self) -> UpEmbedded:
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True
        ).start()
        deadline = time.monotonic() + self.timeout_s
        while not self.console:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.__exit__()
                raise RuntimeError(
                    "megha up did not print its console:\n" + "".join(self.printed)
                ) from None
            self.printed.append(line)
            words = line.split()
            if words[:2] == ["GM", "gm-1"]:
                self.gm = words[2]
            elif words[:1] == ["console"]:
                self.console = words[1]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def headless_chromium(width: int = 1280, height: int = 900):
    """A selenium driver of Debian's Chromium, headless (as root: without its sandbox)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        raise RuntimeError(
            "needs Debian's chromium and chromium-driver "
            "(apt-get install -y chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def sim(count: int, seconds: float, cpu_milli: int = 1000) -> list[common_pb2.Task]:
    tasks = []
    for _ in range(count):
        task = common_pb2.Task(expected_duration_s=seconds)
        task.resources.cpu_milli, task.resources.memory_mb = cpu_milli, 512
        task.sim.duration_s = seconds
        tasks.append(task)
    return tasks


async def populate(gm: str) -> str:
    """Jobs worth a look; the id of the job whose page is shown (it printed something)."""
    async with GlobalMasterClient(gm) as client:
        for i in range(6):
            await client.submit(sim(4 + i, 0.05 + 0.05 * i), job_id=f"batch-{i}")
        talk = common_pb2.Task(process=common_pb2.ProcessExecutor(
            args=["sh", "-c", "echo 'training epoch 1/3'; echo 'training epoch 2/3'; "
                  "echo 'training epoch 3/3'; echo done"]))  # fmt: skip
        talk.resources.cpu_milli, talk.resources.memory_mb = 500, 128
        await client.submit([talk, *sim(3, 0.2)], job_id="train")
        await asyncio.sleep(3)
        await client.submit(sim(4, 600, cpu_milli=4000), job_id="long-runner")
        await asyncio.sleep(1)
        await client.submit(sim(1, 60, cpu_milli=4000), job_id="waits")
        await asyncio.sleep(1)
    return "train"


def shoot(base: str, out: Path, job_id: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    urls = {
        "federation": "federation",
        "queues": "queues",
        "jobs": "jobs",
        "job": f"jobs/{job_id}?task={job_id}.0",
        "allocations": "allocations",
    }
    driver = headless_chromium()
    written = []
    try:
        for name in PAGES:
            driver.set_window_size(1280, 900)
            driver.get(base + urls[name])
            time.sleep(2.5)  # one live update in: the header says when
            path = out / f"{name}.png"
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(1280, min(max(600, height + 140), 1800))
            time.sleep(0.3)
            driver.save_screenshot(str(path))
            written.append(path)
        driver.get(base + "jobs/waits")
        time.sleep(2.5)
        driver.save_screenshot(str(out / "job-waiting.png"))
        written.append(out / "job-waiting.png")
    finally:
        driver.quit()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "console"))
    args = parser.parse_args()
    with UpEmbedded() as up:
        job_id = asyncio.run(populate(up.gm))
        for path in shoot(up.console, Path(args.out), job_id):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
