"""A real Docker engine for the tests that run containers, found without a registry.

Tests that need one are marked ``docker`` and skip, saying why, when this machine has no
engine that answers or no image to run: nothing is pulled. ``.ci/run`` starts an engine
and builds the images of ``scripts/offline_images.sh`` before it runs ``pytest -m docker``.
"""

from __future__ import annotations

import functools
import os

import pytest

# Small images that have ``sh`` and ``sleep``, the first one found locally is used.
CANDIDATES = ("megha-offline/debian:bookworm", "python:3.11-slim", "alpine:3.20")


@functools.cache
def local_image() -> str | None:
    """An image the engine already has (``MEGHA_TEST_IMAGE`` first), else None."""
    try:
        import docker

        client = docker.from_env(timeout=10)
        try:
            client.ping()
            for name in filter(None, (os.environ.get("MEGHA_TEST_IMAGE"), *CANDIDATES)):
                try:
                    client.images.get(name)
                    return name
                except docker.errors.ImageNotFound:
                    continue
        finally:
            client.close()
    except Exception:
        return None
    return None


def needs_docker(test):
    """Mark ``test`` as a ``docker`` test that skips without an engine and a local image."""
    reason = (
        "no Docker engine that answers with a local image of "
        + ", ".join(CANDIDATES)
        + " (scripts/offline_images.sh builds them)"
    )
    return pytest.mark.docker(pytest.mark.skipif(local_image() is None, reason=reason)(test))
