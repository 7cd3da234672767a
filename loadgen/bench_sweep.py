"""``megha-loadgen bench-live --rate R1,R2,...``: the live benchmark at several offered rates.

    for each rate: bench-live (a fresh federation) ──▶ DIR/rate-<R>/{summary.json, tasks.csv, CDF}
    all rates ──▶ DIR/sweep.json (one row per rate) + DIR/sweep.png (latency and CPU vs rate)

``--sweep``: the rates are chosen by a bounded search instead (``saturation.RateSearch``:
doubling from ``--rate``, then bisection, at most ``--sweep-runs`` runs of ``--seconds``
each) for the highest rate that meets ``--target-p99-ms`` with every offered task placed;
DIR/saturation.json says which, and sweep.png draws the target.

Where a federation stops keeping up on a machine is a curve, not a point: allocation time
is flat while the processes have CPU to spare and climbs steeply once they do not. The
sweep draws that curve, with the CPU the federation used at each rate, so a latency
target can be read off as "met up to R tasks/s on this machine".
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadgen import report
from loadgen.bench_live import (
    BenchError,
    BenchOptions,
    BenchResult,
    render,
    run_bench,
    run_main,
)
from loadgen.saturation import BREACH, RateSearch, target_met, verdict

SWEEP_FILE = "sweep.json"
SATURATION_FILE = "saturation.json"
PLOT_FILE = "sweep.png"


def parse_rates(text: str) -> list[float]:
    """``"50,100,200"`` -> [50.0, 100.0, 200.0]; every rate positive, none repeated."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BenchError(f"--rate: {text!r} is not a number or a comma-separated list") from None
    if not rates or any(not r > 0 for r in rates):
        raise BenchError("--rate must be positive")
    if len(set(rates)) != len(rates):
        raise BenchError("--rate lists a rate twice")
    return rates


def sweep_row(result: BenchResult) -> dict[str, Any]:
    s = result.summary
    cpu = s.get("cpu") or {}
    return {
        "offered_rate": s["offered_rate"],
        "placed_per_s": s["throughput_tasks_per_s"],
        "alloc_s": s["alloc_s"],
        "completed": s["completed"],
        "tasks": s["tasks"],
        "duplicates": s["duplicates"],
        "cpu_cores": cpu.get("cores"),
        "other_cores": cpu.get("other_cores"),
        "cpu_ms_per_task": round(sum(cpu.get("ms_per_task", {}).values()), 3) if cpu else None,
        "host_cpus": (s.get("host") or {}).get("cpus"),
        "refused_tasks": s.get("refused_tasks", 0),
        "submit_errors": s["submit_errors"],
        "verdict": verdict(s).kind,
    }


@dataclass
class Sweep:
    results: list[BenchResult]
    files: list[Path] = field(default_factory=list)  # sweep.json and sweep.png

    search: dict[str, Any] | None = None  # --sweep: what saturation.json holds

    @property
    def ok(self) -> bool:
        """No run breached exactly once (saturated runs are measurements)."""
        return all(r.ok for r in self.results)


async def run_sweep(
    options: BenchOptions, rates: Sequence[float], say: Callable[[str], None] = print
) -> Sweep:
    """``bench-live`` once per rate, each against a federation of its own."""
    for rate in rates:  # every option error before the first federation starts
        dataclasses.replace(options, rate=rate, out=None).check()
    sweep = Sweep([])
    for rate in rates:
        out = options.out / f"rate-{rate:g}" if options.out is not None else None
        say(f"bench-live sweep: {rate:g} tasks/s")
        result = await run_bench(dataclasses.replace(options, rate=rate, out=out), say=say)
        say(render(result))
        sweep.results.append(result)
    _write(sweep, options.out)
    return sweep


def _write(sweep: Sweep, out: Path | None, target_ms: float | None = None) -> None:
    if out is None:
        return
    rows = sorted(map(sweep_row, sweep.results), key=lambda r: r["offered_rate"])
    path = out / SWEEP_FILE
    path.write_text(json.dumps(rows, indent=2) + "\n")
    sweep.files = [path]
    if sweep.search is not None:
        found = out / SATURATION_FILE
        found.write_text(json.dumps(sweep.search, indent=2) + "\n")
        sweep.files.append(found)
    plot = plot_sweep(rows, out / PLOT_FILE, target_ms)
    sweep.files += [plot] if plot else []


async def search_rate(
    options: BenchOptions,
    target_p99_ms: float,
    max_runs: int,
    say: Callable[[str], None] = print,
) -> Sweep:
    """The highest offered rate whose run meets ``target_p99_ms`` with every offered task
    placed exactly once: ``RateSearch`` from ``options.rate``, one fresh federation per
    run. Stops early at an exactly-once breach (that is a bug to look at, not a rate)."""
    options.check()
    search = RateSearch(start=options.rate, max_runs=max_runs)
    sweep = Sweep([])
    runs = []
    while (rate := search.next_rate()) is not None:
        out = options.out / f"rate-{rate:g}" if options.out is not None else None
        say(
            f"bench-live sweep: {rate:g} tasks/s, run {len(search.tried) + 1} of at most {max_runs}"
        )
        result = await run_bench(dataclasses.replace(options, rate=rate, out=out), say=say)
        say(render(result))
        sweep.results.append(result)
        met, why = target_met(result.summary, target_p99_ms / 1e3)
        search.record(rate, met)
        runs.append({"offered_rate": rate, "met": met, "why": why})
        say(f"bench-live sweep: {rate:g} tasks/s {'meets' if met else 'misses'} the target: {why}")
        if verdict(result.summary).kind == BREACH:
            break
    sweep.search = {
        "target_p99_ms": target_p99_ms,
        "highest_rate_meeting_target": search.best,
        "lowest_rate_missing_target": search.lowest_missed,
        "max_runs": max_runs,
        "seconds_per_run": options.seconds,
        "runs": runs,
    }
    _write(sweep, options.out, target_p99_ms)
    return sweep


def render_sweep(sweep: Sweep) -> str:
    lines = [
        "offered/s  placed/s  alloc p50 ms  p90 ms  p99 ms  completed      CPU cores  ms/task",
    ]
    for row in map(sweep_row, sweep.results):
        alloc = row["alloc_s"]
        cores = "-" if row["cpu_cores"] is None else f"{row['cpu_cores']:.2f}"
        if row["other_cores"]:
            cores += f" (+{row['other_cores']:.2f} other)"
        per_task = "-" if row["cpu_ms_per_task"] is None else f"{row['cpu_ms_per_task']:.2f}"
        lines.append(
            f"{row['offered_rate']:>9g}  {row['placed_per_s']:>8.0f}  "
            f"{report.ms(alloc['p50']):>12}  {report.ms(alloc['p90']):>6}  "
            f"{report.ms(alloc['p99']):>6}  {row['completed']:>6}/{row['tasks']:<6}  "
            f"{cores:<10} {per_task}"
        )
    if sweep.search is not None:
        found, missed = (
            sweep.search["highest_rate_meeting_target"],
            sweep.search["lowest_rate_missing_target"],
        )
        target = f"allocation p99 <= {sweep.search['target_p99_ms']:g} ms, every task placed"
        lines.append(
            (
                f"highest rate meeting {target}: {found:g} tasks/s"
                if found is not None
                else f"no rate tried met {target}"
            )
            + (f" (missed at {missed:g})" if missed is not None else " (none tried missed it)")
            + f", {len(sweep.search['runs'])} runs"
        )
    for path in sweep.files:
        lines.append(f"wrote {path}")
    return "\n".join(lines)


def plot_sweep(
    rows: Sequence[dict[str, Any]], path: Path, target_ms: float | None = None
) -> Path | None:
    """Allocation-time percentiles (log ms) and CPU cores against the offered rate, with
    the p99 target when a search had one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rates = [r["offered_rate"] for r in rows]
    fig, (lat, cpu) = plt.subplots(1, 2, figsize=(10, 4))
    for key, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        values = [1e3 * r["alloc_s"][key] if r["alloc_s"][key] is not None else None for r in rows]
        lat.plot(rates, values, style, label=key)
    if target_ms is not None:
        lat.axhline(target_ms, color="r", linestyle=":", label=f"p99 target {target_ms:g} ms")
    lat.set_yscale("log")
    lat.set_xlabel("offered tasks/s")
    lat.set_ylabel("allocation time (ms)")
    lat.grid(True, which="both", alpha=0.3)
    lat.legend()
    cores = [r["cpu_cores"] or 0.0 for r in rows]
    other = [r["other_cores"] or 0.0 for r in rows]
    cpu.bar(rates, cores, width=0.6 * min(_gaps(rates)), label="federation + load generator")
    cpu.bar(rates, other, bottom=cores, width=0.6 * min(_gaps(rates)), label="rest of the host")
    if rows[0]["host_cpus"]:
        cpu.axhline(rows[0]["host_cpus"], color="k", linestyle=":", label="cores of this host")
    cpu.set_xlabel("offered tasks/s")
    cpu.set_ylabel("CPU cores busy")
    cpu.legend()
    fig.suptitle("megha bench-live: allocation time and CPU against offered rate")
    report.save_figure(fig, path)
    plt.close(fig)
    return path


def _gaps(rates: Sequence[float]) -> list[float]:
    ordered = sorted(rates)
    gaps = [b - a for a, b in itertools.pairwise(ordered)]
    return gaps or [max(ordered[0], 1.0)]


def run(options: BenchOptions, rates: Sequence[float]) -> int:
    """The CLI entry of a sweep: 0 = every acknowledged task of every rate completed
    exactly once (saturated rates included), 1 = not."""
    return run_main(
        lambda: run_sweep(options, rates),
        lambda sweep: (render_sweep(sweep), sweep.ok),
    )


def run_search(options: BenchOptions, target_p99_ms: float, max_runs: int) -> int:
    """The CLI entry of ``--sweep``: as ``run``, with the rates the search picks."""
    return run_main(
        lambda: search_rate(options, target_p99_ms, max_runs),
        lambda sweep: (render_sweep(sweep), sweep.ok),
    )
