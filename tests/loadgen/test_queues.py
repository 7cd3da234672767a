import numpy as np
import pytest

from loadgen.queues import (
    Attempts,
    QueueFileError,
    assign_queues,
    load_queues,
    measured_shares,
    peak_held,
)
from services.common.config import QueueConfig

QUEUES = (
    QueueConfig(name="q1", share=0.25, gm="gm-1"),
    QueueConfig(name="q2", share=0.75, gm="gm-2"),
)


def test_a_queue_file_is_read_and_bad_ones_are_refused_with_the_entry(tmp_path):
    good = tmp_path / "queues.yaml"
    good.write_text("- {name: q1, share: 0.1, gm: gm-1}\n- {name: q2, share: 0.5, gm: 3}\n")
    # the GM is named as a federation file names it, whichever way the file gave it
    assert load_queues(good) == (
        QueueConfig(name="q1", share=0.1, gm="gm-1"),
        QueueConfig(name="q2", share=0.5, gm="gm-3"),
    )
    good.write_text("- {name: q1, share: 1, gm: gm2, limit: 'cpu=2,mem=1Gi'}\n")
    assert load_queues(good) == (
        QueueConfig(name="q1", share=1.0, gm="gm-2", limit="cpu=2,mem=1Gi"),
    )
    bad = {
        "- {name: q1, share: 0.6, gm: 1}\n- {name: q2, share: 0.6, gm: 1}\n": "add up to 1.20",
        "- {name: q1, share: 0, gm: 1}\n": "queue 1 \\(q1\\): 'share'",
        "- {name: q1, share: true, gm: 1}\n": "queue 1 \\(q1\\): 'share'",
        "- {name: q1, gm: 1}\n": "queue 1 \\(q1\\): 'share'",
        "- {share: 0.5, gm: 1}\n": "queue 1: 'name' must be",
        "- {name: q1, share: 0.1, gm: 0}\n": "'gm' must be a GM id",
        "- {name: q1, share: 0.1, gm: leader}\n": "'gm' must be a GM id",
        "- {name: q1, share: 0.1, gm: 1, weight: 2}\n": "unknown keys",
        "- {name: q1, share: 0.1, gm: 1}\n- {name: q1, share: 0.1, gm: 1}\n": "unique",
        "- {name: q1, share: 0.1, gm: 1, limit: cpu=0}\n": "'limit' 'cpu=0': a limit must be",
        "- {name: q1, share: 0.1, gm: 1, limit: 4}\n": "expected a string such as cpu=16",
        "name: q1\n": "non-empty list",
    }
    for text, message in bad.items():
        good.write_text(text)
        with pytest.raises(QueueFileError, match=message):
            load_queues(good)


def test_tasks_go_round_robin_unless_the_trace_names_users():
    first = np.array([0, 3, 5, 6])
    assert assign_queues(["", "", ""], first, QUEUES).tolist() == [0, 1, 0, 1, 0, 1]
    # a user named like a queue lands there; other users keep one queue each
    got = assign_queues(["q2", "alice", "bob"], first, QUEUES).tolist()
    assert got == [1, 1, 1, 0, 0, 1]


def test_measured_share_is_averaged_only_while_every_queue_waits():
    s = 1_000_000_000
    # Everything is enqueued at 1 s; q0 holds 1 of 4 cores and q1 3, and each has one
    # more task waiting until 6 s, when two tasks end and the waiting ones start.
    attempts = Attempts(
        queue=np.array([0, 1, 1, 1, 0, 1]),
        enqueued=np.full(6, s),
        started=np.array([1, 1, 1, 1, 6, 6]) * s,
        ended=np.array([6, 10, 10, 6, 10, 10]) * s,
        cpu_milli=np.full(6, 1000),
        memory_mb=np.zeros(6),
    )
    shares, window = measured_shares(attempts, 2, total_cpu=4000, total_memory=0)
    assert window == 5.0  # 1 s .. 6 s: after 6 s nothing waits
    assert shares == [0.25, 0.75]
    # never all backlogged at once -> no measurement
    lone = Attempts(*(a[:1] for a in attempts.__dict__.values()))
    assert measured_shares(lone, 2, 4000, 0) == ([None, None], 0.0)


def test_the_peak_a_queue_held_counts_ends_before_starts_at_the_same_moment():
    s = 1_000_000_000
    # q0: 1 core from 1 to 5 s, 2 from 5 to 8 s (starts as the first ends), 1 from 2 s
    # never ending (counted to the end of the run); q1 never starts anything.
    attempts = Attempts(
        queue=np.array([0, 0, 0, 1]),
        enqueued=np.full(4, s),
        started=np.array([1, 5, 2, 0]) * s,
        ended=np.array([5, 8, 0, 0]) * s,
        cpu_milli=np.array([1000, 2000, 1000, 500]),
        memory_mb=np.array([100, 50, 10, 7]),
    )
    assert peak_held(attempts, 2).tolist() == [[3000, 110], [0, 0]]
    assert peak_held(Attempts(*(a[3:] for a in attempts.__dict__.values())), 2).tolist() == [
        [0, 0],
        [0, 0],
    ]
