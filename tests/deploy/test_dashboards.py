"""deploy/: the Grafana dashboard and the Prometheus alert rules use only metrics the
services export, and promtool accepts the rules (and their unit tests) and the config."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from tests.common.test_metrics_documented import MODULES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
RULES = DEPLOY / "prometheus" / "alerts.yml"
# Series Prometheus makes itself for every scrape target.
PROMETHEUS_OWN = {"up"}
# PromQL words that may stand before "(" or "{" but are no series.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "on", "and", "or", "unless", "without", "ignoring", "absent", "label_replace",
}  # fmt: skip


def exported() -> set[str]:
    """Every series name the services' metrics expose."""
    names = set()
    for module in MODULES:
        for metric in vars(module).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            (family,) = metric.describe()
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
            else:
                names.add(family.name)
    return names


def series(expr: str) -> set[str]:
    """The metric names an expression reads: every megha_ name, and any other name that
    selects series (followed by ``{`` or ``[``)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values are no names
    names = set(re.findall(r"\bmegha_\w+", expr))
    names |= set(re.findall(r"\b([a-zA-Z_:][\w:]*)\s*[{\[]", expr))
    return names - PROMQL_WORDS


def dashboard_exprs(path: Path) -> list[str]:
    panels = json.loads(path.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def test_the_dashboard_and_alerts_read_only_exported_metrics():
    known = exported() | PROMETHEUS_OWN
    assert "megha_allocation_duration_seconds_bucket" in known  # the scan found them
    assert DASHBOARDS, "no dashboard in deploy/grafana"
    used: set[str] = set()
    for where, exprs in [*((p.name, dashboard_exprs(p)) for p in DASHBOARDS),
                         (RULES.name, rule_exprs())]:  # fmt: skip
        assert exprs, f"{where} has no expressions"
        for expr in exprs:
            unknown = series(expr) - known
            assert not unknown, f"{where}: {expr!r} reads {sorted(unknown)}, not exported"
            used |= series(expr)
    # The series helper is no sieve that lets everything through.
    assert series('rate(nope_total{a="b"}[5m])') == {"nope_total"}
    assert {"megha_allocation_duration_seconds_bucket", "megha_queue_pending_tasks"} <= used


def test_the_alerts_cover_what_operators_page_for():
    names = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    assert {
        "MeghaGlobalMasterDown", "MeghaLocalMasterDown", "MeghaHeartbeatsStale",
        "MeghaAllocationP99High", "MeghaQueueStarving",
    } <= names  # fmt: skip


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install prometheus; .ci/run does)",
)
@pytest.mark.parametrize(
    "argv",
    [
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
        ["check", "config", "prometheus.yml"],
    ],
    ids=["check-rules", "test-rules", "check-config"],
)
def test_promtool_accepts_the_rules(argv):
    done = subprocess.run(
        [PROMTOOL, *argv], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
