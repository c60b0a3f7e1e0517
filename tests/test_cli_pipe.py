"""``mqttring`` subcommands whose reader goes away (``mqttring status ... | head``)."""

from __future__ import annotations

import subprocess
import sys


def test_a_closed_pipe_ends_a_subcommand_quietly() -> None:
    """A reader that stops early (``head``) made ``status`` print a BrokenPipeError
    traceback (a probe, 8 of 8); now it ends with exit 0 and nothing on stderr.  The
    subcommand here raises what its ``print`` raised there."""
    code = ("import sys\n"
            "from mqttring import cli\n"
            "def fail(args):\n"
            "    raise BrokenPipeError(32, 'Broken pipe')\n"
            "parser = cli.build_parser\n"
            "def patched():\n"
            "    p = parser()\n"
            "    for action in p._subparsers._group_actions:\n"
            "        for sub in action.choices.values():\n"
            "            sub.set_defaults(func=fail)\n"
            "    return p\n"
            "cli.build_parser = patched\n"
            "sys.exit(cli.main(['status', '--node', '127.0.0.1:1']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
