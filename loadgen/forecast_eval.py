"""``megha-loadgen forecast-eval``: the predictive autoscaler against a reactive one, on a
bucket-count series built from a trace (after Gao 2020, "A predictive autoscaler for
elastic batch jobs").

    trace (synthetic or file) ──embed (Alg. 2)──▶ nodes per bucket per interval D[t]
          │ first --train-fraction: history only
          ▼ every --refit-every intervals: refit on the history so far (at most 4 weeks)
    forecast F[t+1] from D[..t] ──scale_plan──▶ pool for t+1 ──vs D[t+1]──▶ pending / idle

The pool model, the same for every autoscaler: at the end of interval t the autoscaler
has seen D[t] and sets the pool for t+1; nodes asked for then are ready when t+1 starts
(a provisioning delay of one interval) and surplus nodes are released at the same time.

- **reactive**: pool[t+1] = D[t], the demand it observed last interval;
- **predictive**: pool[t+1] = max(round(F[t+1]), D[t]) (``services/core/forecast.py``
  ``scale_plan``; never below current demand), the surplus held by placeholders;
- **reactive_headroom_H**: the reactive pool plus H % (rounded up), the usual static
  answer to the delay; it shows whether a forecast beats spending the same idle nodes
  blindly;
- **oracle**: the predictive rule with a perfect forecast, as a bound.

Per autoscaler: **pending node-hours** sum(max(D - pool, 0)) x interval (demand that
waited for a node), **over-provisioned node-hours** sum(max(pool - D, 0)) x interval,
the same two in core-hours (shapes differ in size), and the share of intervals with
some demand pending. ``pending avoided`` compares with the reactive autoscaler.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.demand_trace import (
    DEFAULT_BUCKETS,
    BucketSeries,
    bucket_series,
    demand_from_jobs,
    synthetic_demand,
)
from services.common.argtypes import (
    bounded,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from services.core.buckets import BucketError
from services.core.forecast import (
    ForecastError,
    GradientBoostedForecaster,
    NaiveForecaster,
    SeasonalForecaster,
    Seasons,
    scale_plan,
)
from services.core.resources import ResourceError, parse_resources

DEFAULT = {"days": 35.0, "interval_s": 900.0, "train_fraction": 0.6}
MAX_TRAIN_DAYS = 28  # refits see at most this much history: old weeks stop helping


@dataclass(frozen=True)
class Forecasts:
    """Forecasts of ``series.counts[at]`` per method, each (len(at), B)."""

    at: np.ndarray
    by_method: dict[str, np.ndarray]


def rolling_forecasts(
    series: BucketSeries,
    train_fraction: float = DEFAULT["train_fraction"],
    refit_every: int | None = None,
    lags: int = 6,
    quantile: float | None = 0.9,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Forecasts:
    """One-interval-ahead forecasts for every interval after the training part: naive,
    seasonal, the gradient-boosted mean (``gbm``) and, with ``quantile``, the
    gradient-boosted quantile (``gbm_q90`` for 0.9). The models are refitted every
    ``refit_every`` intervals (default: a day) on the history before that point."""
    counts, unix_s, interval_s = series.counts, series.unix_s, series.interval_s
    total = len(counts)
    seasons = Seasons.for_interval(interval_s)
    start = round(total * train_fraction)
    if not 3 <= start < total:
        raise ValueError(
            f"train fraction {train_fraction} leaves {start} of {total} intervals to train on "
            "and the rest to evaluate; need at least 3 and one"
        )
    at = np.arange(start, total)
    by_method = {
        "naive": NaiveForecaster().forecast(counts, unix_s, at),
        "seasonal": SeasonalForecaster(seasons).forecast(counts, unix_s, at),
    }
    variants = {"gbm": None}
    if quantile is not None:
        variants[f"gbm_q{round(quantile * 100)}"] = quantile
    step = refit_every or min(seasons.day, max(1, (total - start) // 10))
    refits = list(range(start, total, step))
    out = {name: np.empty((len(at), counts.shape[1])) for name in variants}
    max_train = MAX_TRAIN_DAYS * seasons.day
    for i, refit_at in enumerate(refits):
        lo = max(0, refit_at - max_train)
        chunk = np.arange(refit_at, min(refit_at + step, total))
        for name, q in variants.items():
            model = GradientBoostedForecaster(
                seasons, interval_s, lags=lags, quantile=q, seed=seed
            ).fit(counts[lo:refit_at], unix_s[lo:refit_at])
            out[name][chunk - start] = model.forecast(counts, unix_s, chunk)
        if progress is not None:
            progress(i + 1, len(refits))
    by_method.update(out)
    return Forecasts(at=at, by_method=by_method)


def autoscale(
    series: BucketSeries, forecasts: Forecasts, headrooms_pct: Sequence[float] = (5.0, 10.0)
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Rows per autoscaler (see module doc) and each autoscaler's pool (len(at), B)."""
    counts, at = series.counts, forecasts.at
    demand, observed = counts[at], counts[at - 1]
    hours = series.interval_s / 3600.0
    cores = series.buckets[:, 0] / 1000.0
    pools = {"reactive": observed}
    for pct in headrooms_pct:
        pools[f"reactive_headroom_{pct:g}"] = np.ceil(observed * (1 + pct / 100.0)).astype(np.int64)
    for name in ("seasonal", "gbm", *[m for m in forecasts.by_method if m.startswith("gbm_q")]):
        # the pool after scale_plan's additions (surplus beyond the target released)
        pools[f"predictive_{name}"] = scale_plan(
            forecasts.by_method[name], observed, observed
        ).target
    pools["oracle"] = scale_plan(demand, observed, observed).target
    rows = []
    for name, pool in pools.items():
        short = np.maximum(demand - pool, 0)
        idle = np.maximum(pool - demand, 0)
        rows.append(
            {
                "autoscaler": name,
                "pending_node_hours": round(float(short.sum() * hours), 2),
                "overprovisioned_node_hours": round(float(idle.sum() * hours), 2),
                "pending_core_hours": round(float((short * cores).sum() * hours), 1),
                "overprovisioned_core_hours": round(float((idle * cores).sum() * hours), 1),
                "pending_intervals_pct": round(float((short.sum(axis=1) > 0).mean() * 100), 2),
            }
        )
    base = rows[0]
    for row in rows:
        avoided = base["pending_node_hours"] - row["pending_node_hours"]
        extra = row["overprovisioned_node_hours"] - base["overprovisioned_node_hours"]
        row["pending_avoided_pct"] = (
            round(100 * avoided / base["pending_node_hours"], 1)
            if base["pending_node_hours"]
            else None
        )
        row["extra_idle_per_pending_avoided"] = round(extra / avoided, 2) if avoided > 0 else None
    return rows, pools


def forecast_errors(series: BucketSeries, forecasts: Forecasts) -> list[dict]:
    """MAE and RMSE in nodes per bucket and interval, per method, and MAE relative to naive."""
    truth = series.counts[forecasts.at]
    naive_mae = float(np.abs(forecasts.by_method["naive"] - truth).mean())
    rows = []
    for name, f in forecasts.by_method.items():
        err = f - truth
        mae = float(np.abs(err).mean())
        rows.append(
            {
                "method": name,
                "mae_nodes": round(mae, 3),
                "rmse_nodes": round(float(np.sqrt((err**2).mean())), 3),
                "mae_vs_naive": round(mae / naive_mae, 3) if naive_mae else None,
            }
        )
    return rows


def run_forecast_eval(
    series: BucketSeries,
    train_fraction: float = DEFAULT["train_fraction"],
    refit_every: int | None = None,
    lags: int = 6,
    quantile: float | None = 0.9,
    seed: int = 0,
    headrooms_pct: Sequence[float] = (5.0, 10.0),
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Everything ``forecast.json`` holds; deterministic for a series and seed."""
    forecasts = rolling_forecasts(
        series, train_fraction, refit_every, lags, quantile, seed, progress
    )
    rows, pools = autoscale(series, forecasts, headrooms_pct)
    by_name = {r["autoscaler"]: r for r in rows}
    return {
        "interval_s": series.interval_s,
        "intervals": len(series.counts),
        "evaluated_intervals": len(forecasts.at),
        "buckets": series.buckets.tolist(),
        "mean_demand_nodes": series.counts[forecasts.at].mean(axis=0).round(2).tolist(),
        "unfit_tasks": series.unfit_tasks,
        "predictive": by_name["predictive_gbm"],
        "reactive": by_name["reactive"],
        "autoscalers": rows,
        "forecast_errors": forecast_errors(series, forecasts),
        "_plot": (series, forecasts, pools),  # for ``plot``; dropped before writing
    }


def format_table(rows: Sequence[dict]) -> str:
    lines = [
        f"{'autoscaler':<22} {'pending node-h':>14} {'over-prov node-h':>16} "
        f"{'pending core-h':>14} {'over-prov core-h':>16} {'pending %int':>12} {'avoided':>8}"
    ]
    for r in rows:
        avoided = "" if r["pending_avoided_pct"] is None else f"{r['pending_avoided_pct']:.1f} %"
        lines.append(
            f"{r['autoscaler']:<22} {r['pending_node_hours']:>14.1f} "
            f"{r['overprovisioned_node_hours']:>16.1f} {r['pending_core_hours']:>14.1f} "
            f"{r['overprovisioned_core_hours']:>16.1f} {r['pending_intervals_pct']:>11.1f}% "
            f"{avoided:>8}"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path, days: float = 2.0) -> None:
    """Top: demand, the reactive and the predictive pools of the busiest bucket over the
    first ``days`` evaluated; bottom: pending vs over-provisioned node-hours per autoscaler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, forecasts, pools = result["_plot"]
    at = forecasts.at
    b = int(np.argmax(series.counts[at].sum(axis=0)))
    n = min(len(at), int(days * 86_400 / series.interval_s))
    hours = (series.unix_s[at[:n]] - series.unix_s[at[0]]) / 3600.0
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), gridspec_kw={"height_ratios": [3, 2]})
    top.plot(hours, series.counts[at[:n], b], color="black", lw=1.2, label="demand")
    top.step(hours, pools["reactive"][:n, b], where="post", lw=0.9, label="reactive pool")
    for name in [p for p in pools if p.startswith("predictive_gbm")]:
        label = f"predictive pool ({name.removeprefix('predictive_')})"
        top.step(hours, pools[name][:n, b], where="post", lw=0.9, label=label)
    shape = series.buckets[b]
    top.set_title(
        f"bucket {b} ({shape[0] / 1000:g} cores, {shape[1] / 1024:g} GiB), "
        f"first {n} intervals evaluated"
    )
    top.set_xlabel("hours")
    top.set_ylabel("nodes")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    for row in result["autoscalers"]:
        point = (row["overprovisioned_node_hours"], row["pending_node_hours"])
        below = row["autoscaler"].startswith("predictive")  # keeps neighbours' labels apart
        bottom.scatter(*point, marker="o" if below else "s")
        bottom.annotate(row["autoscaler"], point, textcoords="offset points",
                        xytext=(5, -10 if below else 4), fontsize=8)  # fmt: skip
    bottom.set_xlabel("over-provisioned node-hours")
    bottom.set_ylabel("pending node-hours")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ command line
# --quantile: a level in [0, 1), 0 for no quantile model.
_quantile_or_zero = bounded(float, "quantile", 0, high=1, high_open=True)


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``forecast-eval`` on a ``megha-loadgen`` subparsers object; run it with ``main``."""
    parser = subparsers.add_parser(
        "forecast-eval",
        help="predictive (forecast) vs reactive autoscaling on a bucket-count series",
        description=(
            "Embed a trace's tasks into resource buckets (node shapes), forecast the "
            "bucket counts one interval ahead, and compare the predictive autoscaler with "
            "a reactive one (one interval of provisioning delay): pending node-hours "
            "avoided vs over-provisioned node-hours. Prints a table; with --out writes "
            "forecast.json and forecast.png."
        ),
    )
    parser.add_argument(
        "--trace", type=Path, help="a trace file instead of the synthetic generator"
    )
    parser.add_argument(
        "--format",
        choices=("tr", "google2019", "alibaba2018"),
        help="trace format (default: from the name)",
    )
    parser.add_argument(
        "--max-jobs", type=positive_int, help="read only the first N jobs of --trace"
    )
    parser.add_argument(
        "--days",
        type=positive_float,
        default=DEFAULT["days"],
        help="synthetic trace length (default %(default)s)",
    )
    parser.add_argument(
        "--tasks-per-hour",
        type=positive_float,
        default=900.0,
        help="synthetic weekday peak arrival rate (default %(default)s)",
    )
    parser.add_argument(
        "--bursts-per-day",
        type=non_negative_float,
        default=1.0,
        help="synthetic bursts (default %(default)s)",
    )
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=DEFAULT["interval_s"],
        help="seconds per interval (default %(default)s)",
    )
    parser.add_argument(
        "--bucket",
        action="append",
        metavar="RESOURCES",
        help="a node shape, e.g. cpu=4,mem=16Gi (repeat; default 4/16, 16/64, 64/256 cores/GiB)",
    )
    parser.add_argument(
        "--train-fraction",
        type=fraction,
        default=DEFAULT["train_fraction"],
        help="leading share of the series used only as history (default %(default)s)",
    )
    parser.add_argument(
        "--refit-every", type=positive_int, help="intervals between refits (default: a day)"
    )
    parser.add_argument(
        "--lags", type=positive_int, default=6, help="lag features 1..k (default %(default)s)"
    )
    parser.add_argument(
        "--quantile",
        type=_quantile_or_zero,
        default=0.9,
        help="also a quantile gbm at this level (0: none)",
    )
    parser.add_argument(
        "--headroom",
        type=non_negative_float,
        nargs="*",
        default=[5.0, 10.0],
        help="static headroom %% for the reactive_headroom baselines (default 5 10)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", type=Path, help="write forecast.json and forecast.png here")
    return parser


def build_series(args: argparse.Namespace) -> BucketSeries:
    """The bucket-count series the flags ask for; ``ValueError`` / ``OSError`` say why not."""
    buckets = (
        np.array([parse_resources(b) for b in args.bucket], dtype=np.int64)
        if args.bucket
        else DEFAULT_BUCKETS
    )
    if args.trace is not None:
        from loadgen.readers.dispatch import read_trace

        demand = demand_from_jobs(read_trace(args.trace, args.format, max_jobs=args.max_jobs))
        return bucket_series(demand, buckets, args.interval)
    demand = synthetic_demand(
        days=args.days,
        interval_s=args.interval,
        tasks_per_hour=args.tasks_per_hour,
        bursts_per_day=args.bursts_per_day,
        seed=args.seed,
    )
    return bucket_series(demand, buckets, args.interval, round(args.days * 86_400 / args.interval))


def main(args: argparse.Namespace) -> int:
    """Run ``forecast-eval`` for parsed ``args``; 0 on success, 2 when it could not run."""
    try:
        series = build_series(args)
        print(
            f"forecast-eval: {len(series.counts)} intervals of {args.interval:g} s, "
            f"{len(series.buckets)} buckets, "
            f"{args.trace if args.trace else f'synthetic trace (seed {args.seed})'}"
            + (
                f"; {series.unfit_tasks} tasks fit no bucket and are left out"
                if series.unfit_tasks
                else ""
            )
        )
        result = run_forecast_eval(
            series,
            train_fraction=args.train_fraction,
            refit_every=args.refit_every,
            lags=args.lags,
            quantile=args.quantile or None,
            seed=args.seed,
            headrooms_pct=args.headroom,
            progress=_progress,
        )
    except (ValueError, BucketError, ForecastError, ResourceError, OSError) as err:
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2
    print(format_table(result["autoscalers"]))
    print("one-interval-ahead forecast error (nodes per bucket and interval):")
    for row in result["forecast_errors"]:
        print(f"  {row['method']:<9} MAE {row['mae_nodes']:7.3f}  RMSE {row['rmse_nodes']:7.3f}  "
              f"MAE/naive {row['mae_vs_naive']}")  # fmt: skip
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            plot(result, args.out / "forecast.png")
            written = {k: v for k, v in result.items() if not k.startswith("_")}
            (args.out / "forecast.json").write_text(json.dumps(written, indent=1) + "\n")
        except OSError as err:
            print(f"megha-loadgen: cannot write to {args.out}: {err.strerror}", file=sys.stderr)
            return 2
        print(f"wrote {args.out / 'forecast.json'} and {args.out / 'forecast.png'}")
    return 0


def _progress(done: int, total: int) -> None:
    """A line per refit on a terminal (carriage return), every 10th otherwise."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\rforecast-eval: refit {done}/{total}", end=end, file=sys.stderr, flush=True)
    elif done == total or done % 10 == 0:
        print(f"forecast-eval: refit {done}/{total}", file=sys.stderr, flush=True)
