from pathlib import Path

import pytest

from services.common.config import ConfigError, default_config, load_config, parse_config

EXAMPLE = Path(__file__).parents[2] / "docs" / "federation.example.yaml"


def test_the_documented_example_is_valid():
    config = load_config(EXAMPLE, env={})
    assert config.gm_ids == ["gm-1", "gm-2"]
    assert [q.name for q in config.queues_of("gm-1")] == ["research"]
    assert config.lm("lm-2").target == "127.0.0.1:50053"
    assert config.workers[0].constraints == [0, 3]  # [ssd, gpu]
    assert config.queue("research").limit == "cpu=64,mem=128Gi"
    assert config.pool("burst").node_id(0) == "lm-2-burst-0"


def test_worker_groups_may_name_their_constraints():
    data = {**default_config(), "constraint_names": {"ssd": 3, "gpu": 7}}
    data["workers"] = [{"lm": "lm-1", "constraints": ["ssd", 5, "gpu"]}]
    config = parse_config(data, env={})
    assert config.workers[0].constraints == [3, 5, 7]
    assert config.constraint_labels == {3: "ssd", 7: "gpu"}


def test_autoscale_pools_name_their_nodes_and_may_name_constraints():
    data = {**default_config(), "constraint_names": {"gpu": 3}}
    data["autoscale"] = {"pools": [{"name": "gpu", "lm": "lm-2", "max": 4, "constraints": ["gpu"]}]}
    config = parse_config(data, env={})
    pool = config.pool("gpu")
    assert (pool.constraints, pool.node_id(2), pool.min) == ([3], "lm-2-gpu-2", 0)
    assert pool.group().name_prefix == "lm-2-gpu-" and pool.group().count == 1
    assert config.autoscale.method == "auto" and config.autoscale.interval_s == 60
    with pytest.raises(ConfigError, match=r"no autoscale pool 'cpu' in the config \(known: gpu\)"):
        config.pool("cpu")


def test_default_federation_and_default_queue():
    config = load_config(None, env={})
    assert (len(config.gms), len(config.lms), sum(g.count for g in config.workers)) == (2, 3, 24)
    assert [(q.name, q.gm) for q in config.effective_queues()] == [("default", "gm-1")]
    ports = [g.port for g in config.gms] + [m.port for m in config.lms]
    assert len(set(ports)) == len(ports)


def test_toml_and_environment_overrides(tmp_path):
    path = tmp_path / "fed.toml"
    path.write_text(
        'heartbeat_interval_s = 2.0\n[[gms]]\nid = "g"\nport = 1\n[[lms]]\nid = "l"\nport = 2\n'
    )
    env = {"MEGHA_HEARTBEAT_INTERVAL_S": "0.5", "MEGHA_RABBITMQ_URL": "amqp://x/"}
    config = load_config(path, env=env)
    assert config.heartbeat_interval_s == 0.5 and config.rabbitmq_url == "amqp://x/"
    env = {"MEGHA_QUEUES": "[{name: a, share: 0.3, gm: g}]"}
    assert load_config(path, env=env).queue("a").share == 0.3


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"gms": []}, "gms: List should have at least 1 item"),
        ({"workers": [{"lm": "lm-9"}]}, "unknown LM 'lm-9'"),
        ({"workers": [{"lm": "lm-1", "capacity": "cpu=lots"}]}, "cannot read cpu quantity"),
        ({"workers": [{"lm": "lm-1", "constraints": [30]}]}, "outside 0..20"),
        ({"queues": [{"name": "q", "gm": "gm-7"}]}, "unknown GM 'gm-7'"),
        (
            {"queues": [{"name": "q", "gm": "gm-1", "limit": "cpu=0,mem=1Gi"}]},
            "limit 'cpu=0,mem=1Gi': a limit must be above 0: cpu is 0",
        ),
        ({"queues": [{"name": "q", "gm": "gm-1", "limit": "gpu=1"}]}, "unknown resource 'gpu'"),
        ({"constraint_names": {"7up": 1}}, "constraint name '7up': letters, digits"),
        ({"constraint_names": {"a": 1, "b": 1}}, "two constraint names for one id"),
        ({"constraint_names": {"gpu": 21}}, "constraint_names {'gpu': 21} outside 0..20"),
        (
            {"constraint_names": {"gpu": 3}, "workers": [{"lm": "lm-1", "constraints": ["tpu"]}]},
            "worker group of 'lm-1': unknown constraint 'tpu'; this federation names gpu",
        ),
        (
            {
                "queues": [
                    {"name": "a", "share": 0.7, "gm": "gm-1"},
                    {"name": "b", "share": 0.7, "gm": "gm-1"},
                ]
            },
            "add up to more than 1",
        ),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s: Input should be greater than 0"),
        ({"worker_fence_s": 3}, "worker_fence_s 3 must be 0 (off) or between twice"),
        ({"worker_fence_s": 9.5}, "and worker_timeout_s - 1 (9)"),
        ({"surprise": 1}, "surprise: Extra inputs are not permitted"),
        (
            {"lms": [{"id": "lm-1", "port": 50050}], "workers": [{"lm": "lm-1"}]},
            "LM lm-1 port 127.0.0.1:50050 is also GM gm-1's port",
        ),
        (
            {"predictor": {"port": 7000, "metrics_port": 50150}},
            "predictor metrics_port 127.0.0.1:50150 is also GM gm-1's metrics_port",
        ),
        ({"autoscale": {"pools": []}}, "autoscale.pools: List should have at least 1 item"),
        ({"autoscale": {"pools": [{"name": "b", "lm": "lm-9", "max": 2}]}}, "unknown LM 'lm-9'"),
        (
            {"autoscale": {"pools": [{"name": "b", "lm": "lm-1", "min": 3, "max": 2}]}},
            "pool 'b': min 3 is above max 2",
        ),
        (
            {"autoscale": {"pools": [{"name": "b", "lm": "lm-1", "max": 2}] * 2}},
            "autoscale pool names must be unique",
        ),
        (
            {
                "autoscale": {
                    "pools": [{"name": "b", "lm": "lm-1", "max": 2, "name_prefix": "lm-1-w"}]
                }
            },
            "autoscale pool 'b' names its nodes lm-1-w<n>, as the worker group of 'lm-1' does",
        ),
        (
            {
                "autoscale": {
                    "pools": [{"name": "b", "lm": "lm-1", "max": 2, "constraints": ["tpu"]}]
                }
            },
            "autoscale pool 'b': constraint ids are integers, got 'tpu'",
        ),
        (
            {"autoscale": {"pools": [{"name": "b", "lm": "lm-1", "max": 2, "capacity": "cpu=x"}]}},
            "capacity 'cpu=x'",
        ),
        (
            {"autoscale": {"method": "magic", "pools": [{"name": "b", "lm": "lm-1", "max": 1}]}},
            "method",
        ),
    ],
)
def test_invalid_configs_say_what_is_wrong(change, words):
    data = {**default_config(), **change}
    with pytest.raises(ConfigError, match="invalid config") as err:
        parse_config(data, env={})
    assert words in str(err.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml", env={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("gms: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        load_config(broken, env={})
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(scalar, env={})


def test_one_port_on_two_hosts_is_fine():
    data = default_config()
    data["lms"] = [{"id": "lm-1", "host": "lm-1.example", "port": data["gms"][0]["port"]}]
    data["workers"] = [{"lm": "lm-1", "count": 1}]
    assert parse_config(data, env={}).lm("lm-1").port == data["gms"][0]["port"]


def test_worker_fencing_is_off_by_default_and_bounded_by_the_timeouts():
    assert parse_config(default_config(), env={}).worker_fence_s == 0
    config = parse_config({**default_config(), "worker_fence_s": 7}, env={})
    assert config.worker_fence_s == 7  # in [2 x 2 s heartbeats, 10 s timeout - 1]


def test_the_worker_janitor_is_on_by_default_and_an_environment_variable_turns_it_off():
    assert parse_config(default_config(), env={}).worker_janitor is True
    off = parse_config(default_config(), env={"MEGHA_WORKER_JANITOR": "false"})
    assert off.worker_janitor is False
    with pytest.raises(ConfigError, match="worker_janitor"):
        parse_config(default_config(), env={"MEGHA_WORKER_JANITOR": "maybe"})


def test_tls_is_off_by_default_and_an_environment_variable_can_set_it():
    assert parse_config(default_config(), env={}).tls is None
    env = {"MEGHA_TLS": "{ca: /c.pem, cert: /s.pem, key: /k.pem, server_name: megha}"}
    tls = parse_config(default_config(), env=env).tls
    assert tls is not None
    assert (tls.ca, tls.cert, tls.key, tls.server_name) == ("/c.pem", "/s.pem", "/k.pem", "megha")
    with pytest.raises(ConfigError, match="tls"):
        parse_config(default_config(), env={"MEGHA_TLS": "{ca: /c.pem}"})


def test_node_capacity_is_bounded_per_federation_and_per_lm():
    config = parse_config(default_config(), env={})
    assert config.forget_lost_after_s == 600
    assert config.node_capacity_bound("lm-1").tolist() == [1_024_000, 16 << 20, 1 << 30, 1_000_000]
    data = {**default_config(), "max_node_capacity": "cpu=64"}
    data["lms"] = [{**data["lms"][0], "max_node_capacity": "mem=64Gi"}, *data["lms"][1:]]
    config = parse_config(data, env={"MEGHA_FORGET_LOST_AFTER_S": "0"})
    assert config.forget_lost_after_s == 0
    assert config.node_capacity_bound("lm-1").tolist()[:2] == [64_000, 64 << 10]
    assert config.node_capacity_bound("lm-2").tolist()[:2] == [64_000, 16 << 20]
    # A configured node its LM would refuse is a config error, not a refusal at run time.
    data["workers"] = [{"lm": "lm-1", "capacity": "cpu=4,mem=128Gi"}]
    with pytest.raises(ConfigError, match="above the max_node_capacity of LM 'lm-1'"):
        parse_config(data, env={})
    data["workers"] = []
    data["autoscale"] = {"pools": [{"name": "big", "lm": "lm-2", "max": 2, "capacity": "cpu=65"}]}
    with pytest.raises(ConfigError, match=r"autoscale pool 'big'.*cpu_milli=65000"):
        parse_config(data, env={})
    with pytest.raises(ConfigError, match="above 0"):
        parse_config({**default_config(), "max_node_capacity": "cpu=0"}, env={})
