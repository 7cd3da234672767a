"""The README's metrics table lists every metric the services define, with its labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

import services.common.metrics
import services.common.stalls
import services.common.tasks
import services.global_master.predictions
import services.predictor.service

README = Path(__file__).resolve().parents[2] / "README.md"
# Where the services define their megha_ metrics.
MODULES = (
    services.common.metrics,
    services.common.stalls,
    services.common.tasks,
    services.global_master.predictions,
    services.predictor.service,
)


def _defined() -> dict[str, tuple[str, set[str]]]:
    out = {}
    for module in MODULES:
        for metric in vars(module).values():
            if isinstance(metric, MetricWrapperBase):
                (family,) = metric.describe()
                suffix = "_total" if family.type == "counter" else ""
                out[family.name + suffix] = (family.type, set(metric._labelnames))
    return out


def test_every_metric_is_in_the_readme_table_with_its_type_and_labels():
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `(megha_\w+)` \| (\w+) \| ([\w, ]*) \|", line)
        if m:
            rows[m[1]] = (m[2], {x.strip() for x in m[3].split(",") if x.strip()})
    defined = _defined()
    assert len(defined) >= 17  # the scan found them
    assert rows == defined
