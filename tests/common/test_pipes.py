import subprocess
import sys

SCRIPT = """
from services.common.pipes import quiet_on_broken_pipe

@quiet_on_broken_pipe
def main(argv=None):
    for i in range(200_000):
        print(f"line {i}")
    return 0

raise SystemExit(main())
"""


def test_a_reader_that_stops_early_ends_the_cli_quietly():
    # As `megha job X | head -1`: no traceback, the status of a process killed by SIGPIPE.
    cli = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert cli.stdout is not None and cli.stderr is not None
    assert cli.stdout.readline() == b"line 0\n"
    cli.stdout.close()
    assert cli.wait(30) == 141
    assert cli.stderr.read() == b""
