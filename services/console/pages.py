"""The console's HTML: each page is a layout around one live fragment, rendered on the
server from a ``gather`` record. ``console.js`` fetches the fragment again every few
seconds and swaps it in, so a page follows the federation without a reload.

Everything shown comes from the services: it is escaped (``_e``) before it goes in.
"""

from __future__ import annotations

import html
from typing import Any
from urllib.parse import quote, urlencode

from services.common.reports import Record
from services.core.resources import CPU, format_quantity

PAGES = (
    ("federation", "Federation"),
    ("queues", "Queues"),
    ("jobs", "Jobs"),
    ("allocations", "Allocation times"),
)

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:.6em 1.2em;display:flex;gap:1.5em;align-items:center}
header a{color:#c9d3e3;text-decoration:none}header a.on{color:#fff;font-weight:600}
header .brand{font-weight:700;color:#fff}main{padding:1em 1.2em}
table{border-collapse:collapse;background:#fff;margin:.4em 0 1.2em;min-width:40em}
th,td{padding:.25em .7em;border-bottom:1px solid #e3e6eb;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.alive,.succeeded,.running{color:#17803d}.dead,.failed,.rejected,.silent{color:#b42318}
.draining,.queued,.placed,.retrying,.preempted,.lost{color:#a15c07}.cancelled{color:#667085}
.err{background:#fdecea;color:#b42318;padding:.4em .7em;margin:.4em 0}
.muted{color:#667085}.reason{color:#a15c07}pre{background:#fff;border:1px solid #e3e6eb;
padding:.6em;max-height:24em;overflow:auto}.counts span{margin-right:1em}
.bar{display:inline-block;height:.7em;background:#5b8def;vertical-align:middle}
form.filter{margin:.3em 0 .8em}form.filter *{margin-right:.5em}
#stamp{font-size:12px;color:#98a2b3;margin-left:auto}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def layout(
    title: str, current: str, fragment: str, live_src: str, every_ms: int, head: str = ""
) -> str:
    """A whole page: the nav, ``head`` (e.g. a filter form, not renewed), and ``fragment``
    in the live region ``console.js`` renews every ``every_ms``."""
    nav = "".join(
        f'<a href="/{name}" class="{"on" if name == current else ""}">{label}</a>'
        for name, label in PAGES
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)} · Megha console</title><style>{STYLE}</style>"
        '<script src="/static/console.js" defer></script></head><body>'
        f'<header><span class="brand">Megha</span>{nav}<span id="stamp"></span></header>'
        f'<main><h1>{_e(title)}</h1>{head}<div id="live" data-live="{_e(live_src)}" '
        f'data-every="{every_ms}">{fragment}</div></main></body></html>'
    )


def _errors(errors: list[str]) -> str:
    return "".join(f'<div class="err">{_e(e)}</div>' for e in errors if e)


def _counts(counts: dict[str, int]) -> str:
    cells = "".join(f'<span class="{_e(k)}">{v} {_e(k)}</span>' for k, v in counts.items())
    return f'<p class="counts">{cells or "<span class=muted>none</span>"}</p>'


def _cpu(milli: int) -> str:
    return format_quantity(CPU, milli)


def _table(header: list[str], rows: list[str], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _row(cells: list[tuple[str, str]]) -> str:
    """Cells as (html, css class)."""
    return "<tr>" + "".join(f'<td class="{c}">{h}</td>' for h, c in cells) + "</tr>"


# ---------------------------------------------------------------------- federation
def federation(data: Record) -> str:
    parts = [
        f"<p>{data['nodes']} nodes on {len(data['lms'])} LMs, {len(data['gms'])} GMs</p>",
        _counts(data["counts"]),
        _errors([f"{g['gm_id']} ({g['target']}): {g['error']}" for g in data["gms"] if g["error"]]),
    ]
    labels = data.get("labels", {})
    for lm in data["lms"]:
        parts.append(f'<h2 id="lm-{_e(lm["lm_id"])}">{_e(lm["lm_id"])} '
                     f'<span class="muted">{_e(lm["target"])}</span></h2>')  # fmt: skip
        if lm["error"]:
            parts.append(_errors([f"{lm['lm_id']} does not answer: {lm['error']}"]))
        beats = []
        for gm_id, seen in sorted(lm["heartbeats"].items()):
            state = '<span class="silent">silent</span>' if seen["silent"] else "heard"
            beats.append(f"{_e(gm_id)}: {state} {seen['age_s']:.1f} s ago")
        parts.append(
            f"<p>heartbeats: {'; '.join(beats) or '<span class=silent>no GM hears it</span>'}</p>"
        )
        if lm["partitions"]:
            rows = [
                _row([
                    (_e(p["gm_id"]), ""),
                    (str(p["nodes"]), "n"),
                    (str(p["alive"]), "n"),
                    (str(p["draining"]), "n"),
                    (f"{_cpu(p['cpu_free_milli'])} / {_cpu(p['cpu_milli'])}", "n"),
                    (f"{p['memory_free_mb']} / {p['memory_mb']} Mi", "n"),
                ])
                for p in lm["partitions"]
            ]  # fmt: skip
            parts.append(_table(
                ["partition (GM)", "nodes", "alive", "draining", "CPU free / total",
                 "memory free / total"], rows,
            ))  # fmt: skip
        if lm["nodes"]:
            rows = [
                _row([
                    (_e(n["node_id"]), "node"),
                    (_e(n["state"]), _e(n["state"])),
                    (_e(n["gm_id"]), ""),
                    (f"{_cpu(n['cpu_free_milli'])} / {_cpu(n['cpu_milli'])}", "n"),
                    (f"{n['memory_free_mb']} / {n['memory_mb']} Mi", "n"),
                    (str(n["tasks"]), "n"),
                    (_e(", ".join(labels.get(str(c), str(c)) for c in n["constraints"]) or "-"),
                     ""),
                ])
                for n in lm["nodes"]
            ]  # fmt: skip
            parts.append(_table(
                ["node", "state", "partition", "CPU free / total", "memory free / total",
                 "tasks", "constraints"], rows,
            ))  # fmt: skip
    return "".join(parts)


# -------------------------------------------------------------------------- queues
def _limit(q: Record) -> str:
    if q["limit"] is None:
        return "-"
    held = q["held"] or {}
    return ", ".join(f"{k} {held.get(k, 0)}/{v}" for k, v in q["limit"].items() if v) or "-"


def queues(data: Record) -> str:
    rows = []
    for q in data["queues"]:
        over = q["usage_share"] > q["share"]
        width = int(min(q["usage_share"], 1.0) * 120)
        rows.append(_row([
            (_e(q["queue"]), ""),
            (_e(q["gm_id"]), ""),
            (f"{q['share']:.0%}", "n"),
            (f'<span class="bar" style="width:{width}px"></span> {q["usage_share"]:.0%}'
             + (' <span class="reason">over share</span>' if over else ""), ""),
            ("?" if q["pending_tasks"] is None else str(q["pending_tasks"]), "n"),
            (str(q["running_tasks"]), "n"),
            (_e(_limit(q)), ""),
            (str(q["preempted_tasks"]), "n"),
        ]))  # fmt: skip
    times = data.get("allocation_s", {})
    footer = ""
    if times.get("count"):
        footer = (
            f'<p class="muted">as {_e(data["gm"])} sees them; its last {times["count"]} '
            f"placements: p50 {times['p50'] * 1e3:.1f} ms, p99 {times['p99'] * 1e3:.1f} ms</p>"
        )
    return (
        _errors(data.get("errors", []))
        + _table(
            ["queue", "GM", "share", "usage", "pending", "running", "limit (held/limit)",
             "preempted"], rows,
        )
        + footer
    )  # fmt: skip


# ---------------------------------------------------------------------------- jobs
def jobs_filter(queue: str, state: str, queues_known: list[str], states: list[str]) -> str:
    """The filter form (outside the live region, so typing is not undone by a refresh)."""

    def options(values: list[str], chosen: str, everything: str) -> str:
        opts = [f'<option value="">{everything}</option>']
        opts += [
            f'<option value="{_e(v)}"{" selected" if v == chosen else ""}>{_e(v)}</option>'
            for v in values
        ]
        return "".join(opts)

    return (
        '<form class="filter" method="get" action="/jobs">'
        f'<label>queue <select name="queue">{options(queues_known, queue, "every queue")}'
        f'</select></label><label>state <select name="state">'
        f"{options(['unfinished', *states], state, 'any state')}</select></label>"
        "<button>filter</button></form>"
    )


def _state_cells(states: dict[str, int]) -> str:
    return " ".join(f'<span class="{_e(k)}">{v} {_e(k)}</span>' for k, v in states.items())


def jobs(data: Record) -> str:
    rows = [
        _row([
            (f'<a href="/jobs/{quote(j["job_id"], safe="")}">{_e(j["job_id"])}</a>', "job"),
            (_e(j["queue"]), ""),
            (str(j["tasks"]), "n"),
            (_state_cells(j["states"]), "states"),
        ])
        for j in data["jobs"]
    ]  # fmt: skip
    body = (
        _table(["job", "queue", "tasks", "states"], rows)
        if rows
        else (
            '<p class="muted">no job (a GM remembers the jobs submitted through it and those '
            "it heard run)</p>"
        )
    )
    return (
        _errors(data["errors"])
        + "<h2>tasks of these jobs by state</h2>"
        + _counts(data["counts"])
        + body
    )


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3g} s"


def job(data: Record, output: Record | None = None, shown_task: str = "") -> str:
    rows = []
    for t in data["task_list"]:
        href = f"/jobs/{quote(data['job_id'], safe='')}?" + urlencode({"task": t["task_id"]})
        where = f"{t['lm_id']}/{t['node_id']}" if t["node_id"] else "-"
        note = t["pending_reason"]
        if t["previous_end"]:
            end = t["previous_end"]
            note = f"[attempt {t['attempt']}, after attempt {end['attempt']} {end['state']}] {note}"
        rows.append(_row([
            (f'<a href="{_e(href)}">{_e(t["task_id"])}</a>', "task"),
            (_e(t["state"]), f'state {_e(t["state"])}'),
            (_e(where), "where"),
            (_ms(t["allocation_s"]), "n"),
            (_e(note), "reason"),
        ]))  # fmt: skip
    parts = [
        f"<p><b>{_e(data['job_id'])}</b>: queue {_e(data['queue'])}, {data['tasks']} tasks "
        f'<span class="muted">(as {_e(data["gm_id"])} knows it)</span></p>',
        _counts(data["states"]),
        _table(["task", "state", "LM/node", "allocation time", "pending reason / note"], rows),
    ]
    if output is not None:
        note = f' <span class="muted">{_e(output["note"])}</span>' if output["note"] else ""
        parts.append(
            f"<h2>{_e(output['stream'])} of {_e(shown_task)}{note}</h2>"
            f'<pre id="output">{_e(output["text"])}</pre>'
        )
    return "".join(parts)


# --------------------------------------------------------------------- allocations
def _histogram_svg(histogram: list[int], buckets: list[float]) -> str:
    width, height, bar = 640, 160, 640 // len(buckets)
    top = max(histogram) or 1
    bars = []
    for i, count in enumerate(histogram):
        h = int(count / top * (height - 20))
        label = f"≤ {_ms(buckets[i])}: {count}"
        bars.append(
            f'<rect x="{i * bar}" y="{height - 20 - h}" width="{bar - 2}" height="{h}" '
            f'fill="#5b8def"><title>{_e(label)}</title></rect>'
        )
    ticks = "".join(
        f'<text x="{i * bar}" y="{height - 4}" font-size="10">{_e(_ms(buckets[i]))}</text>'
        for i in range(0, len(buckets), 4)
    )
    return (f'<svg class="histogram" width="{width + 40}" height="{height}" role="img">'
            f"{''.join(bars)}{ticks}</svg>")  # fmt: skip


def _cdf_svg(cdf: list[list[float]], buckets: list[float]) -> str:
    import math

    width, height = 640, 180
    low, high = math.log10(buckets[0]), math.log10(buckets[-1])

    def x(seconds: float) -> float:
        return (math.log10(max(seconds, buckets[0])) - low) / (high - low) * (width - 10)

    points = " ".join(f"{x(s) + 30:.1f},{(1 - f) * (height - 30) + 5:.1f}" for s, f in cdf)
    grid = "".join(
        f'<line x1="30" x2="{width}" y1="{(1 - f) * (height - 30) + 5:.0f}" '
        f'y2="{(1 - f) * (height - 30) + 5:.0f}" stroke="#e3e6eb"/>'
        f'<text x="0" y="{(1 - f) * (height - 30) + 9:.0f}" font-size="10">{f:g}</text>'
        for f in (0, 0.5, 0.9, 0.99, 1)
    )
    ticks = "".join(
        f'<text x="{x(buckets[i]) + 30:.0f}" y="{height - 4}" font-size="10">'
        f"{_e(_ms(buckets[i]))}"
        "</text>"
        for i in range(0, len(buckets), 4)
    )
    return (
        f'<svg class="cdf" width="{width + 40}" height="{height}" role="img">{grid}'
        f'<polyline fill="none" stroke="#17803d" stroke-width="2" points="{points}"/>'
        f"{ticks}</svg>"
    )


def allocations(data: Record) -> str:
    parts = []
    for gm in data["gms"]:
        parts.append(f"<h2>{_e(gm['gm_id'])}</h2>")
        if gm["error"]:
            parts.append(_errors([f"{gm['gm_id']}: {gm['error']}"]))
            continue
        if not gm["count"]:
            parts.append('<p class="muted">no placement of its queues\' tasks yet</p>')
            continue
        parts.append(
            f'<p class="summary">last {gm["count"]} placements: p50 {_ms(gm["p50"])}, '
            f"p90 {_ms(gm['p90'])}, p99 {_ms(gm['p99'])}, max {_ms(gm['max'])}</p>"
            "<h3>histogram (submission to start on a worker)</h3>"
            + _histogram_svg(gm["histogram"], data["buckets_s"])
            + "<h3>CDF</h3>"
            + _cdf_svg(gm["cdf"], data["buckets_s"])
        )
    return "".join(parts)


def not_found(message: str) -> str:
    return f'<div class="err">{_e(message)}</div>'
