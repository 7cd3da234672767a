"""Who may do what, on a real federation (GM, LM, worker hosts as processes, real
RabbitMQ) with per-process certificates from ``megha certs`` and authorization on."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from services._proto.megha.v1 import (
    global_master_pb2,
    global_master_pb2_grpc,
    local_master_pb2,
    local_master_pb2_grpc,
)
from services.app.certs import issue, new_token
from services.common import authz, server
from services.common.client import GlobalMasterClient
from services.common.config import TlsConfig, default_config, parse_config
from tests.integration.harness import Federation, container_health_check, sim_tasks

DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture
def certs(tmp_path):
    """Identities for a federation of up to 2 GMs and 3 LMs, and users alice and bob;
    this test process is the operator (an admin) until a test says otherwise."""
    directory = tmp_path / "certs"
    issue(directory, parse_config(default_config(2, 3)), ["alice", "bob", "carol"])
    tls = {"ca": str(directory / "ca.crt"), "dir": str(directory)}
    server.use_tls(TlsConfig(**tls), "admin/operator")
    yield tls
    server.use_tls(None)
    authz.use_authz(None)


def be(tls: dict, identity: str) -> None:
    """This process's clients show ``identity``'s certificate from now on."""
    server.use_tls(TlsConfig(**tls), identity)


def audit_lines(fed: Federation, process: str) -> list[dict]:
    path = fed.dir / f"audit-{process}.log"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_roles_and_queues_are_enforced_and_every_refusal_is_audited(tmp_path, certs):
    token, digest = new_token()
    users = {
        "alice": {"queues": {"q1": ["submit", "cancel", "watch"]}},
        "bob": {"queues": {"q1": ["submit", "cancel", "watch"]}},
        "carol": {"queues": {"*": ["watch"]}, "token_sha256": digest},
    }
    queues = [
        {"name": "q1", "share": 0.5, "gm": "gm-1"},
        {"name": "q2", "share": 0.5, "gm": "gm-1"},
    ]
    async with Federation(
        tmp_path,
        gms=1,
        lms=1,
        workers_per_lm=2,
        queues=queues,
        tls=certs,
        authz={"users": users, "audit": str(tmp_path / "audit-{process}.log")},
    ) as fed:
        gm_target = fed.config.gm("gm-1").target
        lm_target = fed.config.lm("lm-1").target

        be(certs, "user/alice")
        async with GlobalMasterClient(gm_target) as as_alice:
            job = await as_alice.submit(sim_tasks(2, 30), queue="q1")  # long: still running
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await as_alice.submit(sim_tasks(1, 0.1), queue="q2")
            assert refused.value.code() == DENIED
            assert "user/alice may not submit in queue 'q2'" in refused.value.details()

        be(certs, "user/bob")
        async with GlobalMasterClient(gm_target) as as_bob:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await as_bob.cancel(job.job_id)
            assert refused.value.code() == DENIED
            assert "may not cancel a job of user/alice" in refused.value.details()
            # Nor may bob slip tasks into alice's job by naming it.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await as_bob.submit(sim_tasks(1, 0.1), queue="q1", job_id=job.job_id)
            assert refused.value.code() == DENIED
            assert (await as_bob.job(job.job_id)).job_id == job.job_id  # bob may watch q1

        # A worker host's certificate cannot launch on an LM, nor register with another's.
        be(certs, "worker/lm-1")
        async with server.channel(lm_target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Launch(local_master_pb2.LaunchRequest(), timeout=10)
            assert refused.value.code() == DENIED
            assert "worker/lm-1 may not call Launch" in refused.value.details()
        be(certs, "worker/lm-2")
        async with server.channel(lm_target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            request = local_master_pb2.RegisterWorkerRequest(node_id="forged", worker_address="x")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterWorker(request, timeout=10)
            assert refused.value.code() == DENIED and "not its own" in refused.value.details()

        # A certificate that names no one (what token users show) is answered nothing ...
        be(certs, "client/shared")
        async with server.channel(gm_target) as ch:
            stub = global_master_pb2_grpc.GlobalMasterStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListJobs(global_master_pb2.ListJobsRequest(), timeout=10)
            assert refused.value.code() == DENIED and "no identity" in refused.value.details()
            # ... but with a user's bearer token: carol may watch, not submit.
            bearer = (("authorization", f"Bearer {token}"),)
            listed = await stub.ListJobs(
                global_master_pb2.ListJobsRequest(), metadata=bearer, timeout=10
            )
            assert job.job_id in [j.job_id for j in listed.jobs]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SubmitJob(
                    global_master_pb2.SubmitJobRequest(queue="q1", tasks=sim_tasks(1, 0.1)),
                    metadata=bearer,
                    timeout=10,
                )
            assert refused.value.code() == DENIED
            assert "user/carol may not submit" in refused.value.details()

        be(certs, "user/alice")
        async with GlobalMasterClient(gm_target) as as_alice:
            reply = await as_alice.cancel(job.job_id)
            assert reply.known

        be(certs, "admin/operator")  # for the harness's clean-up
        # The containers' health check (no megha) shows the shared client certificate.
        await container_health_check(gm_target, fed.config_path)
        gm_audit = audit_lines(fed, "gm.gm-1")
        denied = [(a["who"], a["call"]) for a in gm_audit if a["verdict"] == "denied"]
        assert denied == [
            ("user/alice", "SubmitJob"),
            ("user/bob", "CancelJob"),
            ("user/bob", "SubmitJob"),
            ("anonymous", "ListJobs"),
            ("user/carol", "SubmitJob"),
        ]
        allowed = [(a["who"], a["call"]) for a in gm_audit if a["verdict"] == "allowed"]
        assert ("user/alice", "SubmitJob") in allowed and ("user/alice", "CancelJob") in allowed
        lm_audit = audit_lines(fed, "lm.lm-1")
        lm_denied = [(a["who"], a["call"]) for a in lm_audit if a["verdict"] == "denied"]
        assert lm_denied == [("worker/lm-1", "Launch"), ("worker/lm-2", "RegisterWorker")]
        assert all("reason" in a for a in lm_audit if a["verdict"] == "denied")


def test_the_cli_shows_a_users_identity_and_refusals(tmp_path, certs):
    """``MEGHA_IDENTITY`` picks the CLI's certificate; a refusal is printed, exit 1."""
    config = tmp_path / "federation.yaml"
    import yaml

    data = {**default_config(1, 1), "tls": certs, "authz": {"users": {"alice": {}}}}
    config.write_text(yaml.safe_dump(data))
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "certs", "--config", str(config), "--token", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "token_sha256:" in out.stdout
