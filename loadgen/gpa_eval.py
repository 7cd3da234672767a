"""``megha-loadgen gpa-eval``: GPA against the baselines, after Janus & Rzadca (SoCC'17) Sec. 5.

    usage (tasks x R realisations) ──split──> observation half ──> mean, std, percentiles
          │                                                            │ per method:
          │                                                  FitRule ──pack──> machines
          └──────────────> evaluation half ──> per machine and step: sum(usage) > capacity?
                                                                   │
                                  m = machines / (sum of evaluation mean usages / capacity)
                                  q = violating machine-steps / all machine-steps

Methods (``services/core/gpa.py`` ``FitRule``): ``gpa`` rho, ``av`` f (f x mean usage),
``perc`` p (p-th percentile of usage), ``cantelli`` b (mean + b std of the machine's sum).
Every method packs the same instance with the same packer (First Fit by default, then the
paper's rebalancing); rows are averaged over instances. ``m``'s denominator is a
(fractional) lower bound: no packing with fewer machines keeps the evaluation-period
average load at or below capacity.

"At comparable q" (``at_comparable_q``): perc 95 violates rarely (q ~ 2e-5), far below
GPA's paper settings, so ``--extra-rho`` adds smaller rho values on the same instances and
GPA's m is read off its own (q, m) curve at perc 95's q. Each row counts the violating
machine-steps behind its q (``violations``): at q ~ 2e-5 that takes hundreds of instances.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from loadgen.usage import UsageError, read_usage_csv, synthetic_usage
from services.common.argtypes import (
    fraction,
    non_negative_int,
    number_list,
    positive_float,
    positive_int,
)
from services.core.gpa import FitRule, pack

METHODS: dict[str, tuple[float, ...]] = {
    "gpa": (0.1, 0.05, 0.01, 0.001),
    "av": (1.0, 1.25, 2.0),
    "perc": (50.0, 70.0, 90.0, 95.0, 99.0, 100.0),
    "cantelli": (1.0, 1.7, 4.4),
}
DEFAULT = {"instances": 20, "tasks": 1000, "realisations": 400}
FULL = {"instances": 100, "tasks": 1000, "realisations": 1000}
TARGET_REL_ERROR = 0.30  # GPA's |q - rho| / rho at rho = 0.1 and 0.05
COMPARE_PERC = 95.0  # the baseline of the "fewer machines at comparable q" target
FEW_VIOLATIONS = 30  # below this many counted violations, a q is a rough estimate


def _rule(method: str, param: float, obs: np.ndarray, stats: Mapping[str, np.ndarray]) -> FitRule:
    if method == "gpa":
        return FitRule.gpa(stats["mean"], stats["std"], param)
    if method == "cantelli":
        return FitRule.cantelli(stats["mean"], stats["std"], param)
    if method == "av":
        return FitRule.average(stats["mean"], param)
    if method == "perc":
        return FitRule.percentile(np.percentile(obs, param, axis=1))
    raise ValueError(f"unknown method {method!r}; known: {sorted(METHODS)}")


def evaluate_packing(
    bins: np.ndarray, evaluation: np.ndarray, capacity: float
) -> tuple[int, float]:
    """(machines, violation frequency): the share of (machine, step) pairs whose summed
    usage exceeds ``capacity``."""
    machines = int(bins.max()) + 1
    order = np.argsort(bins, kind="stable")
    starts = np.searchsorted(bins[order], np.arange(machines))
    totals = np.add.reduceat(evaluation[order], starts, axis=0)  # (machines, steps)
    return machines, float((totals > capacity).mean())


def run_gpa_eval(
    instances: int = DEFAULT["instances"],
    tasks: int = DEFAULT["tasks"],
    realisations: int = DEFAULT["realisations"],
    seed: int = 0,
    methods: Mapping[str, Sequence[float]] | None = None,
    packer: str = "first-fit",
    rebalance: bool = True,
    capacity: float = 1.0,
    usage_pool: np.ndarray | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """One row per method and parameter, averaged over ``instances``:
    ``{"method", "param", "m", "q", "rel_error", "machines", "violations"}``; ``violations``
    is the number of violating (machine, step) pairs summed over the instances, how much
    evidence the row's q rests on.

    An instance is ``tasks`` tasks with ``realisations`` samples each: synthetic
    (``loadgen.usage``), or drawn without replacement from ``usage_pool`` (tasks x R, e.g.
    read from CSV). The first half of every task's samples is observed (the methods see
    its mean, std, percentiles); the second half is the future they are judged on.
    ``rel_error`` = (q - rho) / rho for GPA rows, None for the others. Deterministic for a
    seed.
    """
    methods = METHODS if methods is None else methods
    if realisations < 4 and usage_pool is None:
        raise ValueError("need at least 4 realisations (2 observed, 2 evaluated)")
    if usage_pool is not None and usage_pool.shape[1] < 4:
        raise ValueError("usage samples need at least 4 realisations per task")
    keys = [(m, float(p)) for m, params in methods.items() for p in params]
    machines = np.zeros((instances, len(keys)))
    ratio = np.zeros((instances, len(keys)))
    violations = np.zeros((instances, len(keys)))
    counted = np.zeros(len(keys), dtype=np.int64)
    for i, child in enumerate(np.random.SeedSequence(seed).spawn(instances)):
        rng = np.random.default_rng(child)
        if usage_pool is None:
            usage = synthetic_usage(tasks, realisations, rng)
        else:
            pick = rng.choice(len(usage_pool), size=min(tasks, len(usage_pool)), replace=False)
            usage = usage_pool[pick]
        half = usage.shape[1] // 2
        obs, evaluation = usage[:, :half], usage[:, half:]
        stats = {"mean": obs.mean(axis=1), "std": obs.std(axis=1, ddof=1)}
        lower_bound = evaluation.mean(axis=1).sum() / capacity
        for j, (method, param) in enumerate(keys):
            rule = _rule(method, param, obs, stats)
            bins = pack(rule, capacity, packer=packer, rebalance=rebalance)
            count, q = evaluate_packing(bins, evaluation, capacity)
            machines[i, j], ratio[i, j], violations[i, j] = count, count / lower_bound, q
            counted[j] += round(q * count * evaluation.shape[1])
        if progress is not None:
            progress(i + 1, instances)
    rows = []
    for j, (method, param) in enumerate(keys):
        q = float(violations[:, j].mean())
        rows.append(
            {
                "method": method,
                "param": param,
                "m": round(float(ratio[:, j].mean()), 4),
                "q": float(f"{q:.6g}"),
                "rel_error": round((q - param) / param, 4) if method == "gpa" else None,
                "machines": round(float(machines[:, j].mean()), 2),
                "violations": int(counted[j]),
            }
        )
    return rows


def check_targets(rows: Sequence[Mapping]) -> list[tuple[str, bool | None, str]]:
    """The issue's targets as (name, met, detail); met is None when the rows cannot tell."""
    gpa = {r["param"]: r for r in rows if r["method"] == "gpa"}
    out: list[tuple[str, bool | None, str]] = []
    for rho in (0.1, 0.05):
        row = gpa.get(rho)
        if row is not None:
            ok = abs(row["rel_error"]) <= TARGET_REL_ERROR
            detail = f"(q - rho)/rho = {row['rel_error']:+.1%}"
            out.append((f"GPA rho={rho:g} relative error within ±30 %", ok, detail))
    cmp = at_comparable_q(rows)
    if cmp is not None and cmp["nearest"] is not None:
        # Comparable q: GPA's curve interpolated to perc 95's q; else the nearest GPA row
        # if within a factor of 2 (q spans five decades across the methods).
        ref, near, m_at_q = cmp["perc"], cmp["nearest"], cmp["gpa_m_at_q"]
        ok: bool | None = None
        if m_at_q is not None:
            ok = m_at_q < ref["m"]
        elif ref["q"] > 0 and abs(_log_q(near["q"]) - _log_q(ref["q"])) <= np.log(2.0):
            ok = near["m"] < ref["m"]
        detail = (
            f"nearest: GPA rho={near['param']:g} m={near['m']:.3f} q={near['q']:.2g}; "
            f"perc 95 m={ref['m']:.3f} q={ref['q']:.2g}"
        )
        if m_at_q is not None:
            detail += f"; GPA at perc 95's q: m={m_at_q:.3f}"
        out.append(("GPA fewer machines than perc 95 at comparable q", ok, detail))
    return out


def compare_to_perc_curve(rows: Sequence[Mapping]) -> list[tuple[float, float, float, float]]:
    """(rho, q, GPA's m, perc's m at the same q) for each GPA row inside the range of q the
    ``perc`` rows span; perc's m is interpolated linearly in log q between its rows. Rows
    without a violation (q = 0) have no place on a log-q curve and are left out."""
    curve = _curve(rows, "perc")
    out = []
    for row in (r for r in rows if r["method"] == "gpa" and r["q"] > 0):
        m_perc = _interpolate_m(curve, row["q"])
        if m_perc is not None:
            out.append((row["param"], row["q"], row["m"], round(m_perc, 4)))
    return out


def at_comparable_q(rows: Sequence[Mapping], perc: float = COMPARE_PERC) -> dict | None:
    """GPA against ``perc`` p at perc p's q: the GPA row nearest in log q, and GPA's m on
    its own (q, m) curve at exactly that q (linear in log q between the two GPA rows around
    it; None when no GPA row violates at least as rarely, or none as often). GPA rows with
    q = 0 have no place on a log-q curve: with no other, ``nearest`` is None too. None
    without a ``perc`` p row or GPA rows."""
    ref = next((r for r in rows if r["method"] == "perc" and r["param"] == perc), None)
    if ref is None or not any(r["method"] == "gpa" for r in rows):
        return None
    gpa = _curve(rows, "gpa")
    nearest = min(gpa, key=lambda r: abs(_log_q(r["q"]) - _log_q(ref["q"])), default=None)
    m_gpa = _interpolate_m(gpa, ref["q"]) if ref["q"] > 0 else None
    return {
        "perc": ref,
        "nearest": nearest,
        "gpa_m_at_q": None if m_gpa is None else round(m_gpa, 4),
        "gpa_q_range": (gpa[0]["q"], gpa[-1]["q"]) if gpa else None,
    }


def format_comparable_q(cmp: Mapping) -> list[str]:
    """The "at comparable q" lines ``main`` prints."""
    ref, near = cmp["perc"], cmp["nearest"]

    def evidence(row: Mapping) -> str:
        n = row.get("violations")
        if n is None:
            return ""
        return f" ({n} violating machine-steps{', few: a rough q' if n < FEW_VIOLATIONS else ''})"

    head = f"at comparable q: perc {ref['param']:g} m={ref['m']:.3f} at q={ref['q']:.3g}"
    if near is None:
        return [f"{head}{evidence(ref)}; no GPA row has a violation (more --instances)"]
    lines = [
        f"{head}{evidence(ref)}; nearest GPA rho={near['param']:g} m={near['m']:.3f} at "
        f"q={near['q']:.3g}{evidence(near)}"
    ]
    if cmp["gpa_m_at_q"] is None:
        low, high = cmp["gpa_q_range"]
        lines.append(
            f"at comparable q: cannot interpolate: GPA's nonzero q spans {low:.3g}-{high:.3g}"
            f" and perc {ref['param']:g}'s q is {ref['q']:.3g} (smaller --extra-rho or more "
            "--instances)"
        )
    else:
        m = cmp["gpa_m_at_q"]
        change = (m - ref["m"]) / ref["m"]
        word = "fewer" if change < 0 else "more"
        lines.append(
            f"at comparable q: GPA interpolated to q={ref['q']:.3g}: m={m:.3f} vs perc "
            f"{ref['param']:g} m={ref['m']:.3f}: {abs(change):.1%} {word} machines"
        )
    return lines


def _curve(rows: Sequence[Mapping], method: str) -> list[Mapping]:
    """A method's rows with q > 0, by q."""
    return sorted((r for r in rows if r["method"] == method and r["q"] > 0), key=lambda r: r["q"])


def _log_q(q: float) -> float:
    return float(np.log(max(q, 1e-9)))


def _interpolate_m(curve: Sequence[Mapping], q: float) -> float | None:
    """m of a method's (q, m) curve at ``q``, linear in log q; None outside its range."""
    qs = [_log_q(r["q"]) for r in curve]
    if len(curve) < 2 or not qs[0] <= _log_q(q) <= qs[-1]:
        return None
    return float(np.interp(_log_q(q), qs, [r["m"] for r in curve]))


def format_table(rows: Sequence[Mapping]) -> str:
    lines = [f"{'method':<9} {'param':>7} {'m':>7} {'q':>9} {'(q-rho)/rho':>12} {'machines':>9}"]
    for r in rows:
        rel = f"{r['rel_error']:+.1%}" if r["rel_error"] is not None else ""
        q = f"{r['q']:.5f}" if r["q"] >= 1e-3 or r["q"] == 0 else f"{r['q']:.2e}"
        lines.append(
            f"{r['method']:<9} {r['param']:>7g} {r['m']:>7.3f} {q:>9} {rel:>12} "
            f"{r['machines']:>9.1f}"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Mapping], path: Path, title: str = "") -> None:
    """Machines (m) against violations (q), one series per method, like the paper's Fig. 8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # q = 0 is drawn at the floor of the log axis, below every measured q
    floor = min([1e-5, *(r["q"] / 2 for r in rows if r["q"] > 0)])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"gpa": "o-", "av": "s-", "perc": "^-", "cantelli": "D-"}
    # label offsets (points) per method, so neighbouring series' labels don't collide
    offsets = {"gpa": (-6, -12), "av": (4, 5), "perc": (-16, 4), "cantelli": (5, -10)}
    for method in dict.fromkeys(r["method"] for r in rows):
        series = [r for r in rows if r["method"] == method]
        qs = [max(r["q"], floor) for r in series]
        ax.plot(qs, [r["m"] for r in series], styles.get(method, "x-"), label=method, ms=5)
        for r, q in zip(series, qs, strict=True):
            ax.annotate(f"{r['param']:g}", (q, r["m"]), textcoords="offset points",
                        xytext=offsets.get(method, (4, 3)), fontsize=7)  # fmt: skip
        if method == "gpa":
            ax.plot([r["param"] for r in series], [r["m"] for r in series], "o", mfc="none",
                    color="grey", ms=7, label="gpa target (q = rho)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("q: frequency of machine capacity violations (log)")
    ax.set_ylabel("m: machines / lower bound")
    ax.set_title(title or "GPA vs. baselines (after Janus & Rzadca, Fig. 8)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ command line
def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``gpa-eval`` on a ``megha-loadgen`` subparsers object; run it with ``main``."""
    parser = subparsers.add_parser(
        "gpa-eval",
        help="GPA's violation rate and machine count against av / perc / Cantelli",
        description=(
            "Reproduce the method of Janus & Rzadca (SoCC'17) Sec. 5: pack instances of "
            "tasks with each method's fit test, then count how often a machine's usage "
            "exceeds its capacity in the unseen half of the samples. Prints a table; with "
            "--out writes gpa.json and gpa.png."
        ),
    )
    parser.add_argument(
        "--instances", type=positive_int, help=f"instances (default {DEFAULT['instances']})"
    )
    parser.add_argument(
        "--tasks", type=positive_int, help=f"tasks per instance (default {DEFAULT['tasks']})"
    )
    parser.add_argument(
        "--realisations",
        type=positive_int,
        help=f"samples per task, half observed (default {DEFAULT['realisations']}; "
        "with --usage-csv: the shortest task's count)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"closer to the paper: {FULL['instances']} instances, {FULL['realisations']} "
        "realisations (minutes, not seconds)",
    )
    parser.add_argument(
        "--rho",
        type=fraction,
        nargs="+",
        default=list(METHODS["gpa"]),
        help="GPA's SLOs to evaluate (default: the paper's %(default)s)",
    )
    parser.add_argument(
        "--extra-rho",
        type=number_list(fraction),
        default=(),
        metavar="RHO,RHO,...",
        help="more GPA SLOs after --rho, comma-separated (e.g. 1e-5,1e-6,1e-7), to reach "
        f"perc {COMPARE_PERC:g}'s q (~2e-5) for the 'at comparable q' line; so rare a q "
        "needs hundreds of --instances",
    )
    parser.add_argument("--packer", choices=("first-fit", "best-fit"), default="first-fit")
    parser.add_argument(
        "--no-rebalance", action="store_true", help="skip the paper's rebalancing step"
    )
    parser.add_argument(
        "--capacity",
        type=positive_float,
        default=1.0,
        help="machine capacity in the samples' unit (default 1.0: normalised usage)",
    )
    parser.add_argument(
        "--usage-csv", type=Path, help="task_id,sample rows instead of synthetic usage"
    )
    parser.add_argument("--out", type=Path, help="write gpa.json and gpa.png here")
    return parser


def main(args: argparse.Namespace) -> int:
    """Run ``gpa-eval`` for parsed ``args``; 0 on success, 2 when it could not run."""
    preset = FULL if args.full else DEFAULT
    instances = args.instances or preset["instances"]
    tasks = args.tasks or preset["tasks"]
    realisations = args.realisations or preset["realisations"]
    pool = None
    try:
        if args.usage_csv is not None:
            _, pool = read_usage_csv(args.usage_csv, args.realisations)
            realisations = pool.shape[1]
        progress = _tty_progress if sys.stderr.isatty() else None
        rows = run_gpa_eval(
            instances=instances,
            tasks=tasks,
            realisations=realisations,
            seed=args.seed,
            methods={**METHODS, "gpa": tuple(dict.fromkeys([*args.rho, *args.extra_rho]))},
            packer=args.packer,
            rebalance=not args.no_rebalance,
            capacity=args.capacity,
            usage_pool=pool,
            progress=progress,
        )
    except (UsageError, ValueError) as err:
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2
    source = str(args.usage_csv) if pool is not None else "synthetic usage"
    print(
        f"gpa-eval: {instances} instances x {min(tasks, len(pool) if pool is not None else tasks)}"
        f" tasks x {realisations} realisations ({source}), {args.packer}"
        f"{'' if args.no_rebalance else ' + rebalancing'}, seed {args.seed}"
    )
    print(format_table(rows))
    verdicts = {True: "met", False: "NOT met", None: "cannot tell"}
    for name, ok, detail in check_targets(rows):
        print(f"target: {name}: {verdicts[ok]} ({detail})")
    for rho, q, m_gpa, m_perc in compare_to_perc_curve(rows):
        print(f"at q={q:.2g}: GPA rho={rho:g} m={m_gpa:.3f}, perc curve m={m_perc:.3f}")
    comparable = at_comparable_q(rows)
    if comparable is not None:
        print("\n".join(format_comparable_q(comparable)))
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpa.json").write_text(json.dumps(rows, indent=1) + "\n")
            plot(rows, args.out / "gpa.png")
        except OSError as err:
            print(f"megha-loadgen: cannot write to {args.out}: {err.strerror}", file=sys.stderr)
            return 2
        print(f"wrote {args.out / 'gpa.json'} and {args.out / 'gpa.png'}")
    return 0


def _tty_progress(done: int, total: int) -> None:
    end = "\n" if done == total else ""
    print(f"\rgpa-eval: instance {done}/{total}", end=end, file=sys.stderr, flush=True)


if __name__ == "__main__":  # until `megha-loadgen gpa-eval` is wired: python -m loadgen.gpa_eval
    _parser = argparse.ArgumentParser(prog="python -m loadgen.gpa_eval")
    add_subcommand(_parser.add_subparsers(dest="command", required=True))
    raise SystemExit(main(_parser.parse_args(["gpa-eval", *sys.argv[1:]])))
