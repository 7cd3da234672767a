"""The authorization policy (pure) and ``megha certs``'s identities."""

from __future__ import annotations

import json

from cryptography import x509

from services.app.certs import identities, issue, new_token
from services.common.authz import (
    PAIRED,
    RPC_ROLES,
    Audit,
    Job,
    Policy,
    Principal,
    Verdict,
    parse_identity,
)
from services.common.config import UserConfig, default_config, parse_config

GM = "/megha.v1.GlobalMaster/"
LM = "/megha.v1.LocalMaster/"
WORKER = "/megha.v1.Worker/"

alice, bob = Principal("user", "alice"), Principal("user", "bob")
USERS = {
    "alice": UserConfig(queues={"q1": ["submit", "cancel", "watch"]}),
    "bob": UserConfig(queues={"q1": ["submit", "cancel", "watch"], "*": ["watch"]}),
    "ops": UserConfig(admin=True),
}


GM_1 = Principal("gm", "gm-1")


def policy(own: Principal = GM_1) -> Policy:
    return Policy(USERS, default_queue="q1", own=own)


def test_identities_come_from_megha_uris_only():
    assert parse_identity("spiffe://megha/gm/gm-1") == Principal("gm", "gm-1")
    assert parse_identity("spiffe://megha/user/alice") == alice
    assert parse_identity("spiffe://other/gm/gm-1") is None
    assert parse_identity("spiffe://megha/root/x") is None  # not a role
    assert parse_identity("spiffe://megha/gm/") is None


def test_only_gms_launch_repartition_and_preempt():
    p = policy(own=Principal("lm", "lm-1"))
    for method in ("Launch", "LaunchStream", "Repartition", "Preempt"):
        assert p.decide_role(Principal("gm", "gm-2"), LM + method).allowed
        for who in (Principal("worker", "lm-1"), alice, Principal("predictor", "predictor")):
            verdict = p.decide_role(who, LM + method)
            assert not verdict.allowed and "may not call" in verdict.reason


def test_a_worker_host_talks_to_its_own_lm_only():
    lm = policy(own=Principal("lm", "lm-1"))
    assert lm.decide_role(Principal("worker", "lm-1"), LM + "RegisterWorker").allowed
    verdict = lm.decide_role(Principal("worker", "lm-2"), LM + "RegisterWorker")
    assert not verdict.allowed and "not its own" in verdict.reason
    worker = policy(own=Principal("worker", "lm-1"))
    assert worker.decide_role(Principal("lm", "lm-1"), WORKER + "StartTask").allowed
    assert not worker.decide_role(Principal("lm", "lm-2"), WORKER + "StartTask").allowed
    assert not worker.decide_role(Principal("gm", "gm-1"), WORKER + "StartTask").allowed
    assert RPC_ROLES.keys() >= PAIRED


def test_users_need_the_right_on_the_queue():
    p = policy()
    assert p.decide(alice, GM + "SubmitJob", "q1", None).allowed
    assert p.decide(alice, GM + "SubmitJob", "", None).allowed  # the default queue
    verdict = p.decide(alice, GM + "SubmitJob", "q2", None)
    assert not verdict.allowed and verdict.reason == "user/alice may not submit in queue 'q2'"
    assert p.decide(bob, GM + "GetJob", None, Job("q2", "user/carol")).allowed  # "*": watch
    assert not p.decide(bob, GM + "SubmitJob", "q2", None).allowed
    stranger = Principal("user", "mallory")
    assert "not a user" in p.decide(stranger, GM + "GetJob", None, None).reason


def test_only_the_owner_or_an_admin_cancels_a_job():
    p = policy()
    job = Job("q1", "user/alice")
    assert p.decide(alice, GM + "CancelJob", None, job).allowed
    verdict = p.decide(bob, GM + "CancelJob", None, job)
    assert not verdict.allowed and verdict.reason == "user/bob may not cancel a job of user/alice"
    assert not p.decide(bob, GM + "CancelJob", None, None).allowed  # unknown here: no
    assert p.decide(Principal("user", "ops"), GM + "CancelJob", None, job).allowed
    assert p.decide(Principal("admin", "operator"), GM + "CancelJob", None, None).allowed


def test_no_identity_and_unlisted_methods_are_refused():
    p = policy()
    assert not p.decide_role(Principal("", ""), GM + "GetJob").allowed
    assert p.decide_role(Principal("", ""), "/grpc.health.v1.Health/Check").allowed
    assert not p.decide_role(alice, "/megha.v1.GlobalMaster/SomethingNew").allowed
    assert p.decide_role(Principal("admin", "x"), "/megha.v1.GlobalMaster/SomethingNew").allowed


def test_the_console_may_query_a_drain_but_not_drain():
    p = policy(own=Principal("lm", "lm-1"))
    console = Principal("console", "console")
    assert p.decide(console, LM + "DrainNode", None, None, query=True).allowed
    assert not p.decide(console, LM + "DrainNode", None, None, query=False).allowed


def test_tokens_are_kept_hashed():
    token, digest = new_token()
    p = Policy({"bob": UserConfig(token_sha256=digest)})
    assert p.user_of_token(token) == bob
    assert p.user_of_token(token + "x") is None
    assert token not in digest


def test_audit_lines_are_json(tmp_path):
    audit = Audit(str(tmp_path / "audit-{process}.log"), "gm.gm-1")
    audit.write(bob, GM + "CancelJob", Verdict(False, "no"), job_id="j1", queue="")
    line = json.loads((tmp_path / "audit-gm.gm-1.log").read_text())
    assert line["who"] == "user/bob" and line["call"] == "CancelJob" and line["job_id"] == "j1"
    assert line["verdict"] == "denied" and line["reason"] == "no" and "queue" not in line


def test_megha_certs_issues_one_identity_per_process_and_user(tmp_path):
    config = parse_config({**default_config(2, 3), "tls": None})
    names = identities(config, ["alice"])
    assert {"gm/gm-1", "lm/lm-3", "worker/lm-2", "admin/operator", "user/alice"} <= set(names)
    written = issue(tmp_path, config, ["alice"])
    cert = x509.load_pem_x509_certificate((tmp_path / "user" / "alice.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "spiffe://megha/user/alice" in sans.get_values_for_type(x509.UniformResourceIdentifier)
    assert oct((tmp_path / "user" / "alice.key").stat().st_mode & 0o777) == "0o600"
    ca = (tmp_path / "ca.crt").read_bytes()
    issue(tmp_path, config)  # again: the CA is kept
    assert (tmp_path / "ca.crt").read_bytes() == ca and len(written) == len(names)


def test_the_federation_file_may_change_who_calls_an_rpc():
    lm = Principal("lm", "lm-1")
    p = Policy(USERS, own=lm, roles={"LocalMaster/DrainNode": ["autoscaler"]})
    console = Principal("console", "console")
    assert not p.decide(console, LM + "DrainNode", None, None, query=True).allowed
    assert p.decide(Principal("autoscaler", "autoscaler"), LM + "DrainNode", None, None).allowed
    assert p.decide_role(console, LM + "GetState").allowed  # the others keep their default


def test_unknown_rpcs_and_roles_in_the_file_are_refused():
    import pytest

    from services.common.config import AuthzConfig

    with pytest.raises(ValueError, match="unknown RPC 'LocalMaster/Drain'"):
        AuthzConfig(roles={"LocalMaster/Drain": ["admin"]})
    with pytest.raises(ValueError, match=r"unknown roles \['root'\]"):
        AuthzConfig(roles={"LocalMaster/DrainNode": ["root"]})
