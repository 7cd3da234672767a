import socket

from services.cli import main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_client_command_without_a_gm_says_how_to_start_one(capsys):
    target = f"127.0.0.1:{_closed_port()}"
    assert main(["status", "--gm", target]) == 1
    err = capsys.readouterr().err
    assert err.startswith("megha: UNAVAILABLE: ")
    assert f"no Global Master answers at {target}; start a federation with `megha up`" in err


def test_up_refuses_a_trace_it_cannot_replay_before_starting_anything(tmp_path, capsys):
    missing = tmp_path / "missing.tr"
    assert main(["up", "--embedded", "--replay", str(missing)]) == 2
    assert f"megha: --replay: [Errno 2] No such file or directory: '{missing}'" in (
        capsys.readouterr().err
    )
    bad = tmp_path / "bad.tr"
    bad.write_text("garbage line\n")
    assert main(["up", "--embedded", "--replay", str(bad)]) == 2
    printed = capsys.readouterr()
    assert f"no jobs in {bad} (1 malformed lines skipped, e.g. bad.tr:1: expected" in printed.err
    assert "federation up" not in printed.out  # refused before anything started
