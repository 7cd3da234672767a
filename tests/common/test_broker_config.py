"""The federation file's broker section: each role's URL and the signing key."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, parse_config

BASE = {
    "rabbitmq_url": "amqps://admin:adminpw@rabbit.example:5671/megha?heartbeat=30",
    "gms": [{"id": "gm-1", "port": 50051}],
    "lms": [{"id": "lm-1", "port": 50052}],
}


def test_each_role_connects_as_its_own_user_with_the_password_from_its_file(tmp_path):
    (tmp_path / "gm.pass").write_text("g/m p@ss:w\n")
    (tmp_path / "lm.pass").write_text("lmpw")
    broker = {
        "gm": {"name": "megha-gm", "password_file": str(tmp_path / "gm.pass")},
        "lm": {"name": "megha-lm", "password_file": str(tmp_path / "lm.pass")},
    }
    config = parse_config({**BASE, "broker": broker}, env={})
    assert config.broker_url("gm") == (
        "amqps://megha-gm:g%2Fm%20p%40ss%3Aw@rabbit.example:5671/megha?heartbeat=30"
    )
    assert config.broker_url("lm") == "amqps://megha-lm:lmpw@rabbit.example:5671/megha?heartbeat=30"
    assert config.broker_url("reader") == BASE["rabbitmq_url"]  # no user: the URL's
    assert config.broker_vhost == "megha"
    assert config.queue_signing_key() is None
    with pytest.raises(ValueError, match="unknown broker role"):
        config.broker_url("worker")


def test_without_a_broker_section_every_role_uses_the_url():
    config = parse_config(BASE, env={})
    assert config.broker_url("gm") == config.broker_url("lm") == BASE["rabbitmq_url"]
    assert config.queue_signing_key() is None
    assert parse_config({**BASE, "rabbitmq_url": "amqp://h:5672/"}, env={}).broker_vhost == "/"


def test_passwords_are_never_inline_and_missing_files_say_which(tmp_path):
    with pytest.raises(ConfigError, match="password_file"):
        parse_config({**BASE, "broker": {"gm": {"name": "megha-gm", "password": "x"}}}, env={})
    config = parse_config(
        {**BASE, "broker": {"gm": {"name": "g", "password_file": str(tmp_path / "nope")}}},
        env={},
    )
    with pytest.raises(ConfigError, match=r"cannot read password file .*nope"):
        config.broker_url("gm")


def test_the_signing_key_comes_from_its_file(tmp_path):
    (tmp_path / "queue.key").write_text("ab" * 32 + "\n")
    broker = {"queue_signing_key": str(tmp_path / "queue.key")}
    assert parse_config({**BASE, "broker": broker}, env={}).queue_signing_key() == b"ab" * 32
    (tmp_path / "queue.key").write_text("short")
    with pytest.raises(ConfigError, match="fewer than 32"):
        parse_config({**BASE, "broker": broker}, env={}).queue_signing_key()


CLUSTER = "amqp://a:apw@n1:5701/megha, amqp://a:apw@n2:5702/megha,amqp://a:apw@n3:5703/megha"


def test_a_cluster_url_list_gives_each_role_its_user_on_every_node(tmp_path):
    (tmp_path / "gm.pass").write_text("gmpw\n")
    broker = {"gm": {"name": "megha-gm", "password_file": str(tmp_path / "gm.pass")}}
    config = parse_config({**BASE, "rabbitmq_url": CLUSTER, "broker": broker}, env={})
    assert config.rabbitmq_urls == [
        "amqp://a:apw@n1:5701/megha",
        "amqp://a:apw@n2:5702/megha",
        "amqp://a:apw@n3:5703/megha",
    ]
    assert config.broker_url("gm") == (
        "amqp://megha-gm:gmpw@n1:5701/megha,amqp://megha-gm:gmpw@n2:5702/megha,"
        "amqp://megha-gm:gmpw@n3:5703/megha"
    )
    assert config.broker_url("lm") == CLUSTER  # no user: the list as written
    assert config.broker_vhost == "megha"


@pytest.mark.parametrize(
    ("urls", "why"),
    [
        ("amqp://n1/a,amqp://n2/b", "one vhost"),
        ("amqp://n1/,amqps://n2/", "one scheme"),
        ("memory://,amqp://n2/", "not a cluster node"),
        (" , ", "names no broker"),
    ],
)
def test_a_url_list_is_one_cluster(urls, why):
    with pytest.raises(ConfigError, match=why):
        parse_config({**BASE, "rabbitmq_url": urls}, env={})


def test_work_queues_are_quorum_queues_unless_the_operator_keeps_classic():
    assert parse_config(BASE, env={}).queue_type == "quorum"
    assert parse_config(BASE, env={"MEGHA_QUEUE_TYPE": "classic"}).queue_type == "classic"
    with pytest.raises(ConfigError, match="queue_type"):
        parse_config({**BASE, "queue_type": "stream"}, env={})
