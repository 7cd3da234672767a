"""The GM uses the predictor sidecar: real processes (GM, LMs, workers, ``megha predictor``
with a trained lifetime model), real gRPC, real RabbitMQ."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from loadgen.vm_trace import synthetic_vm_trace
from services.predictor.lifetime_model import load_model, train_lifetime_model
from services.predictor.service import MODEL_ENV
from tests.integration.harness import Federation, free_ports, sim_tasks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    train = synthetic_vm_trace(vms=3_000, days=5, seed=11, prehistory_days=0)
    model = train_lifetime_model(train.features, train.lifetime_s, max_iter=25, quantile_rows=8_000)
    return model.save(tmp_path_factory.mktemp("model") / "lifetime.pkl")


def featured_tasks(features: list[dict[str, str]]):
    tasks = sim_tasks(len(features), 0.05)
    for task, feats in zip(tasks, features, strict=True):
        task.lifetime_features.update(feats)
    return tasks


async def scrape(port: int, name: str) -> dict[str, float]:
    """Samples of one metric on a Prometheus endpoint, by their label text."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
    body = (await reader.read()).decode()
    writer.close()
    out = {}
    for line in body.splitlines():
        match = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            out[match.group(1) or ""] = float(match.group(2))
    return out


async def test_gm_stores_the_sidecars_lifetime_predictions_and_submits_without_it(
    tmp_path, model_path, monkeypatch
):
    monkeypatch.setenv(MODEL_ENV, str(model_path))  # the children inherit the environment
    port, metrics_port = free_ports(2)
    sample = synthetic_vm_trace(vms=400, days=1, seed=5, prehistory_days=0)
    features = sample.feature_dicts(np.arange(8))
    # What the model the sidecar loaded says about these features at uptime 0.
    expected = load_model(model_path).predict(features, np.zeros(len(features)))
    expected_s = expected.expected_remaining_s
    assert len(set(np.round(expected_s))) > 1, "the sample should get different predictions"

    async with Federation(
        tmp_path,
        gms=1,
        lms=1,
        workers_per_lm=4,
        metrics=True,
        predictor={"port": port, "metrics_port": metrics_port},
    ) as fed:
        gm = fed.gm("gm-1")
        # Tasks with lifetime features get the sidecar's prediction; one without gets none.
        tasks = [*featured_tasks(features), *sim_tasks(1, 0.05)]
        reply = await gm.submit(tasks)
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=60)
        job = await gm.job(reply.job_id)
        predicted = {t.task_id: t.predicted_lifetime_s for t in job.tasks}
        got = np.array([predicted[i] for i in reply.task_ids[:-1]])
        np.testing.assert_allclose(got, expected_s, rtol=1e-6)
        assert predicted[reply.task_ids[-1]] == 0.0

        # One batched PredictLifetime for the job, answered by the model, not the prior.
        served = await scrape(metrics_port, "megha_predictor_predictions_total")
        assert served == {'{source="model"}': len(features)}
        asked = await scrape(fed.config.gm("gm-1").metrics_port, "megha_predictor_requests_total")
        assert asked == {'{gm="gm-1",result="ok",rpc="PredictLifetime"}': 1.0}

        # The sidecar dies: submissions still succeed, quickly, without predictions.
        fed.children.kill("predictor")
        loop = asyncio.get_running_loop()
        ids: set[str] = set()
        for _ in range(3):
            started = loop.time()
            reply = await gm.submit(featured_tasks(features[:2]))
            assert loop.time() - started < 2.0
            ids.update(reply.task_ids)
            job = await gm.job(reply.job_id)
            assert [t.predicted_lifetime_s for t in job.tasks] == [0.0, 0.0]
        await fed.events.wait_succeeded(ids, timeout_s=60)
        asked = await scrape(fed.config.gm("gm-1").metrics_port, "megha_predictor_requests_total")
        errors = await scrape(fed.config.gm("gm-1").metrics_port, "megha_predictor_errors_total")
        # The first failure opens the back-off: the next submissions do not even ask.
        assert asked['{gm="gm-1",result="error",rpc="PredictLifetime"}'] == 1.0
        assert asked['{gm="gm-1",result="skipped",rpc="PredictLifetime"}'] == 2.0
        assert sum(errors.values()) == 1.0
        assert fed.log("gm-gm-1").count("predictor sidecar did not answer") == 1
