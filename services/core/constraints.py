"""Placement constraints: small integers a node satisfies and a task requires.

A set of constraints travels as a 64-bit mask (bit ``c`` set = constraint ``c``): it fits
one protobuf ``fixed64`` and one numpy ``uint64``. Inside a node table each constraint is
a bitarray over nodes, so a task's candidate set is the AND of a handful of vectors.

A federation may name its constraints (``constraint_names: {ssd: 3, gpu: 7}``), as
Kubernetes labels nodes: people then write ``ssd,gpu`` where the wire carries ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MAX_CONSTRAINTS = 64
# The Megha paper (after Sharma et al., SoCC'11) synthesises 21 constraints.
DEFAULT_NUM_CONSTRAINTS = 21


# What a constraint name may look like: not a number, nothing that splits a list.
CONSTRAINT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


class ConstraintError(ValueError):
    """A constraint id is out of range or unknown to the federation."""


def to_mask(constraints: Iterable[int], num_constraints: int = MAX_CONSTRAINTS) -> int:
    """Fold constraint ids into a mask, rejecting ids the federation does not know."""
    mask = 0
    for c in constraints:
        c = int(c)
        if not 0 <= c < num_constraints:
            known = f"0..{num_constraints - 1}"
            raise ConstraintError(f"unknown constraint {c}; this federation knows {known}")
        mask |= 1 << c
    return mask


def from_mask(mask: int) -> list[int]:
    """The constraint ids set in ``mask``, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def parse_constraints(
    text: str, num_constraints: int = MAX_CONSTRAINTS, names: Mapping[str, int] | None = None
) -> int:
    """Parse ``"3,7,12"`` (spaces allowed, empty = none) into a mask; with ``names`` (the
    federation's ``constraint_names``), ``"ssd,gpu,12"`` too."""
    return to_mask(constraint_ids(text.split(","), names), num_constraints)


def constraint_ids(items: Iterable[int | str], names: Mapping[str, int] | None = None) -> list[int]:
    """Ids for a list of ids and names (``[3, "ssd", "7"]``); empty items are skipped.
    Range checks are ``to_mask``'s."""
    ids = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            ids.append(item)
            continue
        text = str(item).strip()
        if not text:
            continue
        if text.isdigit():
            ids.append(int(text))
        elif names and text in names:
            ids.append(names[text])
        elif names:
            known = ", ".join(sorted(names))
            raise ConstraintError(f"unknown constraint {text!r}; this federation names {known}")
        else:
            raise ConstraintError(
                f"constraint ids are integers, got {text!r} (this federation names no "
                "constraints: constraint_names in its file)"
            )
    return ids


def describe_constraints(ids: Iterable[int], labels: Mapping[int, str] | None = None) -> str:
    """``"3 (ssd), 7"``: ids as people named them, where they did."""
    labels = labels or {}
    return ", ".join(f"{c} ({labels[c]})" if c in labels else str(c) for c in ids)
