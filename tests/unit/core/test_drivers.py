"""DESIGN.md: the live services and the simulator are *drivers* of services/core. They
turn events into calls of the core and its actions into messages; none of them decides
where a task goes. Checked on the source: a driver that matches, reserves, plans a
preemption or books a launch on an LM's state itself fails here."""

import ast
from pathlib import Path

import services

ROOT = Path(services.__file__).parent.parent
DRIVERS = [
    *sorted((ROOT / "services").rglob("*.py")),
    *sorted((ROOT / "loadgen").rglob("*.py")),
]
CORE = ROOT / "services" / "core"
# GlobalView's decisions: only services.core.scheduler calls them.
VIEW_DECISIONS = {"match", "reserve", "reserve_preemption", "preemption_plan"}
# ClusterState's decisions: only services.core.lm_lifecycle calls them.
BOOKS_DECISIONS = {"launch", "repartition", "preempt"}


def _receiver(node: ast.expr) -> str:
    """The last name of what an attribute is read on: ``self.view`` -> ``view``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def decisions_in(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        receiver = _receiver(node.value).lower()
        if (node.attr in VIEW_DECISIONS and "view" in receiver) or (
            node.attr in BOOKS_DECISIONS and receiver.endswith("state")
        ):
            found.append(f"line {node.lineno}: {receiver}.{node.attr}")
    return found


def test_no_driver_makes_a_scheduling_decision():
    offenders = []
    for path in DRIVERS:
        if CORE in path.parents or "_proto" in path.parts:
            continue
        for where in decisions_in(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)} {where}")
    assert not offenders, "decisions belong in services/core: " + "; ".join(offenders)


def test_the_check_catches_a_decision_added_to_a_driver():
    driver = """
class GM:
    def round(self, spec):
        placement = self.view.match(spec)
        self.view.reserve(placement, spec)
        place = lm.state.repartition if placement.repartition else lm.state.launch
"""
    assert decisions_in(driver) == [
        "line 4: view.match",
        "line 5: view.reserve",
        "line 6: state.repartition",
        "line 6: state.launch",
    ]
