"""Job files (``megha submit --file``): what they build, and how their mistakes are named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.jobfile import MAX_TASKS, JobFileError, load_job
from services.core.resources import parse_resources

EXAMPLE = """
job_id: sweep-1
queue: research
defaults:
  resources: cpu=500m,mem=256Mi
  retries: 1
  env: {DATA: /srv/data}
tasks:
  - command: [python3, train.py, --lr, "0.1"]
  - command: python3 train.py --lr 0.01
    resources: cpu=2,mem=2Gi
    env: {LR: "0.01"}
  - image: megha-offline/debian:bookworm
    command: [sh, -c, "echo $MEGHA_TASK_INDEX"]
    count: 3
    timeout: 30
    constraints: [1, 4]
  - duration: 2.5                # the defaults' env is not for it
    retries: 0
"""


def test_a_job_file_builds_each_task_with_the_defaults_under_it() -> None:
    job, templates = load_job(EXAMPLE, num_constraints=21)
    assert (job.job_id, job.queue, len(templates)) == ("sweep-1", "research", 6)
    first, second, container, *more, simulated = [t.build() for t in templates]
    assert list(first.process.args) == ["python3", "train.py", "--lr", "0.1"]
    assert (first.resources.cpu_milli, first.resources.memory_mb) == (500, 256)
    assert (first.max_retries, dict(first.process.env)) == (1, {"DATA": "/srv/data"})
    assert list(second.process.args) == ["sh", "-c", "python3 train.py --lr 0.01"]
    assert (second.resources.cpu_milli, second.resources.memory_mb) == (2000, 2048)
    assert dict(second.process.env) == {"DATA": "/srv/data", "LR": "0.01"}  # added to
    assert container.docker.image == "megha-offline/debian:bookworm"
    assert list(container.docker.args) == ["sh", "-c", "echo $MEGHA_TASK_INDEX"]
    assert (container.docker.timeout_s, list(container.constraints)) == (30, [1, 4])
    assert more == [container, container]  # count: 3
    assert simulated.WhichOneof("executor") == "sim" and simulated.sim.duration_s == 2.5
    assert simulated.max_retries == 0  # its own 0 wins over the default's 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tasks: [{command: ls, resources: cpu=lots}]", "tasks[0]: "),
        ("tasks: [{duration: 1}, {command: ls, comand: x}]", "tasks[1].comand: Extra inputs"),
        ("tasks: [{command: ls, retries: 101}]", "tasks[0].retries: Input should be less than"),
        ("tasks: [{command: []}]", "tasks[0].command: an empty command runs nothing"),
        ("tasks: [{command: [sleep, 5]}]", "command: argument 1 (5) is not a string: quote"),
        ("tasks: [{command: ls, constraints: [1, x]}]", "tasks[0]: constraint ids are integers"),
        ("tasks: [{command: ls, constraints: [1, 2.5]}]", "constraints are ids or names, got"),
        ("tasks: [{command: ls, env: {1X: y}}]", "tasks[0].env: '1X' is not a variable name"),
        ("tasks: [{duration: 1, env: {X: y}}]", "tasks[0]: env is for a process"),
        ("tasks: [{command: ls, constraints: '99'}]", "tasks[0]: "),
        ("tasks: [{command: ls, count: 0}]", "tasks[0].count: Input should be greater than"),
        ("tasks: []", "tasks: List should have at least 1 item"),
        ("job_id: x", "tasks: Field required"),
        ("- command: ls", "a job file is a mapping with a list of tasks"),
        ("tasks: [{command: ls}\nqueue: [", "line 2, column 1: not YAML"),
        ("tasks: [{command: ls, timeout: -1}]", "tasks[0].timeout: Input should be greater"),
    ],
)
def test_each_mistake_is_named_by_where_it_is(text: str, expected: str) -> None:
    with pytest.raises(JobFileError) as raised:
        load_job(text, num_constraints=21)
    assert expected in str(raised.value), str(raised.value)


def test_every_mistake_is_told_at_once_and_a_job_has_a_bound() -> None:
    text = "tasks: [{command: ls, resources: cpu=x}, {command: ls, resources: mem=y}]"
    with pytest.raises(JobFileError) as raised:
        load_job(text, num_constraints=21)
    assert [line[:8] for line in str(raised.value).splitlines()] == ["tasks[0]", "tasks[1]"]
    with pytest.raises(JobFileError, match="at most 100,000"):
        load_job(f"tasks: [{{duration: 1, count: {MAX_TASKS}}}, {{duration: 1}}]", 21)


@given(
    st.lists(
        st.tuples(st.integers(1, 5), st.integers(1, 64_000), st.integers(1, 65_536)),
        min_size=1,
        max_size=8,
    )
)
def test_counts_and_resources_come_out_as_written(rows: list[tuple[int, int, int]]) -> None:
    lines = ["tasks:"]
    for count, cpu, mem in rows:
        lines.append(
            f'  - {{command: ["true"], count: {count}, resources: "cpu={cpu}m,mem={mem}Mi"}}'
        )
    _, templates = load_job("\n".join(lines), num_constraints=21)
    expected = [
        parse_resources(f"cpu={cpu}m,mem={mem}Mi") for count, cpu, mem in rows for _ in range(count)
    ]
    assert len(templates) == len(expected)
    assert all((t.resources == e).all() for t, e in zip(templates, expected, strict=True))


def test_constraints_may_be_the_names_the_federation_gives_them() -> None:
    names = {"ssd": 3, "gpu": 7}
    text = (
        "defaults: {constraints: [ssd]}\n"
        "tasks: [{duration: 1}, {duration: 1, constraints: 'gpu, 1'}]"
    )
    _, (first, second) = load_job(text, num_constraints=21, constraint_names=names)
    assert (first.constraints, second.constraints) == ([3], [1, 7])
    with pytest.raises(
        JobFileError, match=r"tasks\[0\]: unknown constraint 'tpu'; this federation names gpu, ssd"
    ):
        load_job("tasks: [{duration: 1, constraints: [tpu]}]", 21, names)


def test_a_task_may_have_a_priority_and_the_defaults_give_one() -> None:
    text = "defaults: {priority: 3}\ntasks: [{duration: 1}, {duration: 1, priority: -2}]"
    _, (first, second) = load_job(text, num_constraints=21)
    assert (first.build().priority, second.build().priority) == (3, -2)
    with pytest.raises(JobFileError, match=r"tasks\[0\]\.priority: Input should be less than"):
        load_job("tasks: [{duration: 1, priority: 2147483648}]", 21)
