"""Fixtures shared by every test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.task_user import task_writable_dir


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, so a failing random test fails the same way again."""
    return np.random.default_rng(1234)


@pytest.fixture
def task_tmp() -> Iterator[Path]:
    """Like ``tmp_path``, but process tasks may write in it too: under a root test run
    they run as ``nobody``, to whom ``tmp_path`` (mode 0700) is closed."""
    with task_writable_dir() as path:
        yield path


# Two suites are slow and run apart, by ``.ci/run``, which keeps ``pytest -q`` within its
# budget: the chaos suite (tests/chaos, and live fault tests elsewhere marked ``chaos``),
# run with MEGHA_CHAOS_TESTS=1, and other long live tests marked ``slow``, run with
# MEGHA_SLOW_TESTS=1. So do the console's tests in a real browser (``browser``), run with
# MEGHA_BROWSER_TESTS=1, and the multi-host test (``multihost``: every role in its own
# network namespace; needs root), run with MEGHA_MULTIHOST_TESTS=1. Otherwise they are
# skipped, loudly.
OPT_IN = {
    "chaos": ("MEGHA_CHAOS_TESTS", "chaos suite"),
    "slow": ("MEGHA_SLOW_TESTS", "slow live tests"),
    "browser": ("MEGHA_BROWSER_TESTS", "the console in a real Chromium"),
    "multihost": ("MEGHA_MULTIHOST_TESTS", "every role in its own network namespace (root)"),
}


def pytest_collection_modifyitems(config, items):
    for marker, (variable, what) in OPT_IN.items():
        if os.environ.get(variable) == "1":
            continue
        skip = pytest.mark.skip(reason=f"{what}: set {variable}=1 (run by .ci/run)")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
