"""A tiny lifetime model shared by the predictor tests (trained once per session)."""

from __future__ import annotations

import pytest

from loadgen.vm_trace import synthetic_vm_trace


@pytest.fixture(scope="session")
def train_trace():
    return synthetic_vm_trace(vms=3_000, days=5, seed=11, prehistory_days=0)


@pytest.fixture(scope="session")
def tiny_model(train_trace):
    from services.predictor.lifetime_model import train_lifetime_model

    return train_lifetime_model(
        train_trace.features, train_trace.lifetime_s, max_iter=100, quantile_rows=8_000
    )


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model, tmp_path_factory):
    return tiny_model.save(tmp_path_factory.mktemp("model") / "lifetime.pkl")
