"""Fixtures shared by every test."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, so a failing random test fails the same way again."""
    return np.random.default_rng(1234)
