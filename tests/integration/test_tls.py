"""A federation over mutual TLS: GM, LM, workers and the CLI as processes, real RabbitMQ."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from services.client import GlobalMasterClient
from services.common import server
from services.common.config import TlsConfig, default_config
from tests.integration.harness import Federation, sim_tasks
from tests.tls_files import make_tls_files

HEALTHCHECK = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"


@pytest.fixture
def tls(tmp_path):
    """The federation's files; this test process's own clients use them too."""
    files = make_tls_files(tmp_path / "tls")
    server.use_tls(TlsConfig(**files))
    yield files
    server.use_tls(None)


async def test_a_federation_runs_over_mutual_tls_and_refuses_other_clients(tmp_path, tls):
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2, tls=tls) as fed:
        reply = await fed.gm().submit(sim_tasks(6, 0.1))  # GM, LM and workers all on TLS
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=20)
        target = fed.config.gm("gm-1").target

        # The CLI reads the same federation file, so it speaks TLS too.
        cli = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "services.cli", "jobs", "--config", str(fed.config_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert reply.job_id in cli.stdout
        # So does the containers' health check, which reads the file without megha.
        env = {**os.environ, "MEGHA_HEALTH_TARGET": target, "MEGHA_CONFIG": str(fed.config_path)}
        probe = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(HEALTHCHECK)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr

        # A plaintext client is refused ...
        server.use_tls(None)
        async with GlobalMasterClient(target) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await plain.jobs()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        # ... and so is one whose certificate another CA signed.
        other = make_tls_files(tmp_path / "other", ca_name="someone else")
        server.use_tls(TlsConfig(ca=tls["ca"], cert=other["cert"], key=other["key"]))
        async with GlobalMasterClient(target) as stranger:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stranger.jobs()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        server.use_tls(TlsConfig(**tls))  # for the harness's own clean-up


def test_tls_files_that_cannot_be_read_stop_the_cli_with_their_name(tmp_path):
    (tmp_path / "not.pem").write_text("hello")
    config = tmp_path / "federation.yaml"

    def megha_jobs(ca: Path) -> subprocess.CompletedProcess:
        tls = {"ca": str(ca), "cert": str(tmp_path / "not.pem"), "key": "x"}
        config.write_text(yaml.safe_dump({**default_config(), "tls": tls}))
        return subprocess.run(
            [sys.executable, "-m", "services.cli", "jobs", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    missing = megha_jobs(tmp_path / "missing.pem")
    assert missing.returncode == 2
    assert f"megha: tls.ca: cannot read {tmp_path / 'missing.pem'}" in missing.stderr
    not_pem = megha_jobs(tmp_path / "not.pem")
    assert not_pem.returncode == 2
    assert f"megha: tls.ca: {tmp_path / 'not.pem'} is not a PEM file" in not_pem.stderr
