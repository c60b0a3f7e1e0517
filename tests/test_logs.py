"""``mqttring.logs.WaitLog``: a wait that retries every 0.2 s logs a few lines, not one a try."""

from __future__ import annotations

import logging

import pytest

from mqttring.logs import WaitLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_a_long_wait_logs_once_at_the_start_every_ten_seconds_and_once_at_the_end(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="test.wait")
    clock = Clock()
    waiting = WaitLog(logging.getLogger("test.wait"), "an answer to join from h:1", clock=clock)
    for _ in range(120):  # 30 s of tries, one every 0.25 s (exact in binary)
        waiting.failed("join via h:1 failed: refused")
        clock.now += 0.25
    waiting.done("join answered by h:1")
    lines = info_lines(caplog)
    assert lines[0] == ("join via h:1 failed: refused; waiting for an answer to join from h:1 "
                        "(retrying; a line every 10 s until then)")
    still = [line for line in lines if line.startswith("still waiting")]
    assert len(still) == 2  # at 10 s and 20 s
    assert still[0].startswith("still waiting for an answer to join from h:1 after 10 s (")
    assert still[0].endswith("last: join via h:1 failed: refused")
    assert lines[-1] == "join answered by h:1 after waiting 30.0 s (120 tries failed)"
    assert len(lines) == 4
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 120 - 3


def test_a_first_try_that_succeeds_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="test.wait")
    waiting = WaitLog(logging.getLogger("test.wait"), "a member", clock=Clock())
    waiting.done("join answered by h:1")
    assert caplog.records == []


def test_a_failed_ask_says_why_even_when_the_exception_does_not() -> None:
    """A timeout or a connection closed without an answer has an empty ``str()``: the join
    log said "join via HOST:PORT failed: " for 30 s (a probe joining through a node's MQTT
    port)."""
    import trio

    from mqttring.raft.service import failure_reason

    assert "no answer in time" in failure_reason(trio.TooSlowError())
    assert "closed without an answer" in failure_reason(EOFError())
    assert failure_reason(ConnectionRefusedError(111, "Connection refused")) == (
        "[Errno 111] Connection refused")
    assert failure_reason(KeyError()) == "KeyError"
