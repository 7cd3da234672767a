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
