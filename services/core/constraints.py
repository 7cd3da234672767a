"""Placement constraints: small integers a node satisfies and a task requires.

A set of constraints travels as a 64-bit mask (bit ``c`` set = constraint ``c``): it fits
one protobuf ``fixed64`` and one numpy ``uint64``. Inside a node table each constraint is
a bitarray over nodes, so a task's candidate set is the AND of a handful of vectors.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_CONSTRAINTS = 64
# The Megha paper (after Sharma et al., SoCC'11) synthesises 21 constraints.
DEFAULT_NUM_CONSTRAINTS = 21


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


def parse_constraints(text: str, num_constraints: int = MAX_CONSTRAINTS) -> int:
    """Parse ``"3,7,12"`` (spaces allowed, empty = none) into a mask."""
    ids = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit():
            raise ConstraintError(f"constraint ids are integers, got {item!r}")
        ids.append(int(item))
    return to_mask(ids, num_constraints)
