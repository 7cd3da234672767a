"""The README's metrics table lists every metric the services register, with its labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import REGISTRY

# Importing these registers every megha_ metric.
import services.common.metrics
import services.global_master.predictions
import services.predictor.service

README = Path(__file__).resolve().parents[2] / "README.md"


MODULES = (services.common.metrics, services.global_master.predictions, services.predictor.service)


def _registered() -> dict[str, tuple[str, set[str]]]:
    assert all(MODULES)
    out = {}
    for collector in list(REGISTRY._collector_to_names):  # every registered collector
        describe = getattr(collector, "describe", None)
        for family in describe() if describe else []:
            if family.name.startswith("megha_"):
                name = family.name + ("_total" if family.type == "counter" else "")
                labels = set(getattr(collector, "_labelnames", ()))
                out[name] = (family.type, labels)
    return out


def test_every_metric_is_in_the_readme_table_with_its_type_and_labels():
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `(megha_\w+)` \| (\w+) \| ([\w, ]*) \|", line)
        if m:
            rows[m[1]] = (m[2], {x.strip() for x in m[3].split(",") if x.strip()})
    registered = _registered()
    assert len(registered) >= 17
    assert rows == registered
