"""The embedding examples in docs/ run as documented (they are the API's contract)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("embed_trio.py", "greetings/world: hello from trio"),
        ("embed_thread.py", "hello from a thread"),
    ],
)
def test_example_runs(script, expected):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
