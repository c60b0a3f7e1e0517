"""Errors an application or an operator sees when a node cannot start, in one line each.

trio reports a failure inside nested nurseries as nested ``ExceptionGroup``\\ s; an
application calling ``MqttRingBroker.start()`` on a busy port wants a plain ``OSError`` that
names the address, and an operator wants one line, not a traceback.  ``ListenError`` is that
typed error (every listener of a node raises it), and ``sole_exception`` digs the one real
failure out of a group so that callers can catch what they expect.
"""

from __future__ import annotations

import os


class ListenError(OSError):
    """A listener could not bind ``address`` (in use, not permitted, cannot be assigned).

    An ``OSError`` (with the original ``errno``), so ``except OSError`` keeps working; its
    text is ``"127.0.0.1:1883: address already in use"``.
    """

    def __init__(self, address: str, cause: OSError) -> None:
        reason = os.strerror(cause.errno) if cause.errno else str(cause)
        super().__init__(cause.errno, f"{address}: {reason[:1].lower()}{reason[1:]}")
        self.address = address

    def __str__(self) -> str:
        return str(self.strerror)


class JoinError(Exception):
    """No member answered a joining node within ``join_timeout`` (``mqttring.raft.service``);
    the message says whom it asked, for what, and the last failure."""


def sole_exception(exc: BaseException) -> BaseException:
    """The one leaf of (nested) exception groups holding exactly one, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc




def describe_error(exc: BaseException) -> str:
    """One line for an operator: the message, or what a bare exception type means."""
    import trio  # here, not at the top: importing mqttring.errors must stay cheap

    exc = sole_exception(exc)
    if isinstance(exc, trio.TooSlowError):
        return "no answer in time (is a Raft majority of the cluster reachable?)"
    if isinstance(exc, EOFError):
        return "connection closed by the peer"
    text = str(exc)
    return text if text else type(exc).__name__


__all__ = ["JoinError", "ListenError", "describe_error", "sole_exception"]
