"""The pysyncobj shell around ``MetadataState``: settings, the replicated ``apply``, files.

This module is deliberately thin.  pysyncobj runs its own thread (``autoTick``); it calls
``ReplicatedMetadata.apply`` there for every committed entry, in log order, on every node.
After each apply we take an immutable ``ClusterView`` snapshot *in that thread* (the state
may change again on the next entry) and hand it to ``on_view``, which must only schedule
work (the service passes ``TrioToken.run_sync_soon``) and never block the Raft thread.

Settings, and why
-----------------
* ``password``: pysyncobj's TCP transport unpickles what it receives, so an open Raft port
  would run anyone's code.  With a password every frame is Fernet-encrypted and
  authenticated; the password is derived from the cluster secret for this purpose only
  (``derive_key(secret, "mqttring-raft-v1")``) so it never equals the RPC key.
* ``useFork=False``: forking a process that runs trio and other threads to write a dump is
  unsafe; the dump is small (members and ~1k shard lists), so it is written in-thread.
* ``dynamicMembershipChange=True``: nodes are added and removed one at a time by the leader.
* ``commandsWaitLeader=False``: with no leader a command fails at once (MISSING_LEADER)
  instead of sitting in a queue and applying minutes later after the caller gave up.  A
  minority partition therefore cannot commit, and callers see it.
* ``appendEntriesUseBatch=False``: metadata commands are rare and small, so each is sent to
  the followers at once instead of waiting for the next 50 ms batch; a commit went from
  ~150 ms to ~7 ms on loopback (``benchmarks/bench_raft.py``).
* Timeouts (``RaftTimeouts``): elections after 0.4-0.8 s of leader silence, heartbeats
  every 50 ms, reconnects every 0.3 s, and a leader that hears from no majority for 2 s
  steps down.  Tuned for a LAN: failover is about one second.  A WAN needs them larger.
* ``transportClass=TimelyTcpTransport``: pysyncobj gives up on an established connection
  that hears nothing for ``connectionTimeout``, but leaves a connection *attempt* pending for
  as long as the kernel retries its SYN (1, 3, 7, 15 s...).  A SYN dropped during a
  partition then keeps the two nodes apart for up to that long after it heals, and a
  minority node that reaches some peers but not the leader keeps calling elections with its
  inflated term, deposing each new leader (measured: a 5-node partition converged 8.8 s
  after the heal, with ten terms of elections).  This transport abandons an attempt pending
  for longer than ``connectionTimeout`` and starts a new one.  Its connections also get
  TCP's linear retransmission timeouts (``mqttring.tcp_options``, under BBR too): on a lossy
  network a heartbeat lost a few times in a row otherwise waits out a doubling backoff, and
  a node that the leader does not count up for 4.5 s fences itself.
* ``ElectionGatedSyncObj``: pre-vote and the leader lease (``prevote.py``), so that a node
  that hears the leader badly, or not at all while it hears the others, cannot depose it.
  pysyncobj has neither and no hook for them, so this subclass reaches into its private
  fields (name-mangled ``_SyncObj__*``): ``setup.cfg`` pins pysyncobj to the versions this
  was checked against, and ``ElectionGatedSyncObj`` refuses to start on one that lacks them.
* ``journalFile`` and ``fullDumpFile`` live in ``<data_dir>/raft/``.  The journal is an
  mmap flushed about once a second, so a kill -9 can lose its tail: nothing is lost that
  the leader cannot resend, because an entry counts as committed only on a majority and a
  restarting node catches up from the leader.  Everything in the state is rebuilt from the
  dump plus the journal (or from the leader, if both are gone).
"""

from __future__ import annotations

import _socket
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.monotonic import monotonic
from pysyncobj.syncobj import _RAFT_STATE
from pysyncobj.tcp_connection import CONNECTION_STATE
from pysyncobj.transport import TCPTransport

from mqttring.raft.prevote import (
    PRE_VOTE,
    PRE_VOTE_RESPONSE,
    STALE_TERM,
    TRANSFER_KEY,
    BadPreVoteMessage,
    ElectionGate,
    LogPosition,
    PreVoteRequest,
    PreVoteResponse,
)
from mqttring.raft.state import Command, MetadataState, Result
from mqttring.tcp_options import for_cluster

# pysyncobj's win_inet_pton replaces socket.inet_ntop on every platform with a shim that
# only works on Windows: anything in a node process decoding an address (psutil, TLS
# libraries, user code embedding the broker) would fail.  Put the real one back.  Here, the
# one module through which mqttring uses pysyncobj (``bridge`` imports it too, and this).
socket.inet_ntop = _socket.inet_ntop

log = logging.getLogger(__name__)

RAFT_PASSWORD_PURPOSE = "mqttring-raft-v1"


@dataclass(frozen=True, slots=True)
class RaftTimeouts:
    append_entries_period: float = 0.05
    election_min: float = 0.4
    election_max: float = 0.8
    connection_timeout: float = 1.0
    connection_retry: float = 0.3
    leader_fallback: float = 2.0


DEFAULT_TIMEOUTS = RaftTimeouts()


class TimelyTcpTransport(TCPTransport):
    """pysyncobj's TCP transport, with connection attempts bounded by ``connectionTimeout``
    and TCP's linear retransmission timeouts on its connections (see the module docstring).
    Runs on the Raft thread, like everything it overrides."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Incoming connections not yet identified as a member, with when each came, in
        #: that order (``_drop_unidentified``).
        self._arrived: dict[Any, float] = {}
        #: Strangers closed since the last warning, and when that was (one line per
        #: ``_WARN_EVERY`` seconds however many come).
        self._closed_unwarned = 0
        self._warned_at = -_WARN_EVERY
        super().__init__(*args, **kwargs)

    def _onNewIncomingConnection(self, conn: Any) -> None:
        _thin_stream(conn)
        _bound_reads(conn)
        super()._onNewIncomingConnection(conn)
        self._arrived[conn] = monotonic()
        self._drop_unidentified()

    def _onTick(self) -> None:
        super()._onTick()
        if self._arrived:
            self._drop_unidentified()

    def _drop_unidentified(self) -> None:
        """Close incoming connections that have not said which member they are: those
        older than ``RAFT_IDENTIFY_TIMEOUT``, and the oldest past
        ``RAFT_MAX_UNIDENTIFIED``.  pysyncobj keeps such a connection for as long as it
        sends nothing (its own timeout is only checked when bytes come), so anyone who
        reaches the port could take every descriptor of the node.  A member identifies
        itself in its first frames, within milliseconds of connecting."""
        arrived, unknown = self._arrived, self._unknownConnections
        for conn in [c for c in arrived if c not in unknown]:
            del arrived[conn]  # identified, or gone
        if not arrived:
            return
        too_old = monotonic() - RAFT_IDENTIFY_TIMEOUT
        stale = [c for c, at in arrived.items() if at < too_old]
        excess = len(arrived) - len(stale) - RAFT_MAX_UNIDENTIFIED
        if excess > 0:  # oldest first: dicts keep arrival order
            stale += [c for c, at in arrived.items() if at >= too_old][:excess]
        for conn in stale:
            arrived.pop(conn, None)
            conn.disconnect()
        self._closed_unwarned += len(stale)
        now = monotonic()
        if self._closed_unwarned and now - self._warned_at >= _WARN_EVERY:
            log.warning("Raft port: closed %d incoming connection(s) that did not identify "
                        "as a member within %d s or came beyond %d pending",
                        self._closed_unwarned, RAFT_IDENTIFY_TIMEOUT, RAFT_MAX_UNIDENTIFIED)
            self._closed_unwarned, self._warned_at = 0, now

    def _onOutgoingConnected(self, conn: Any) -> None:
        _thin_stream(conn)
        super()._onOutgoingConnected(conn)

    def _onMessageReceived(self, node: Any, message: Any) -> None:
        syncobj = self._syncObj
        if not isinstance(syncobj, ElectionGatedSyncObj) or syncobj.screen_message(node, message):
            super()._onMessageReceived(node, message)

    def send(self, node: Any, message: Any) -> bool:
        syncobj = self._syncObj
        if isinstance(syncobj, ElectionGatedSyncObj):
            message = syncobj.tag_vote_request(message)
        return bool(super().send(node, message))

    def _connectIfNecessarySingle(self, node: Any) -> bool:
        conn = self._connections.get(node)
        started = self._lastConnectAttempt.get(node)
        if (conn is not None and started is not None
                and conn.state == CONNECTION_STATE.CONNECTING
                and monotonic() - started > self._syncObj.conf.connectionTimeout):
            conn.disconnect()  # its SYN may sit out a backoff of many seconds: start anew
        return bool(super()._connectIfNecessarySingle(node))


#: Most incoming Raft connections that have not yet said which member they are; beyond it
#: the oldest is closed.  Members identify at once, so only strangers ever wait here.
RAFT_MAX_UNIDENTIFIED = 32
#: Seconds an incoming Raft connection may take to identify as a member before it is closed
#: (checked every tick, about every 50 ms).  Generous against a lossy network's retransmits.
RAFT_IDENTIFY_TIMEOUT = 5
_WARN_EVERY = 10.0

#: Most bytes an incoming Raft connection may hold unparsed.  pysyncobj reads a frame whose
#: 4-byte header announces up to 2 GiB, keeping everything until it is complete, before
#: it can tell that the sender does not know the key: anyone reaching the port could make
#: a node hold gigabytes (and copy them on every read).  Real frames are far smaller
#: (append-entries batches and dump chunks of at most 64 KiB; a read drains the socket,
#: so a few frames may wait together).
RAFT_MAX_BUFFERED = 8 * 2**20


def _bound_reads(conn: Any, limit: int = RAFT_MAX_BUFFERED) -> None:
    """Close ``conn`` once it holds more than ``limit`` unparsed bytes."""
    read = getattr(conn, "_TcpConnection__processRead", None)
    if read is None or not hasattr(conn, "_TcpConnection__readBuffer"):
        return  # a pysyncobj that renamed them: unbounded, as before

    def bounded_read() -> bool:
        more = bool(read())
        if len(conn._TcpConnection__readBuffer) > limit:
            log.warning("Raft port: closed a connection holding over %d bytes of an "
                        "unfinished frame (not a member speaking pysyncobj)", limit)
            conn.disconnect()
            return False
        return more

    conn._TcpConnection__processRead = bounded_read


def _thin_stream(conn: Any) -> None:
    # pysyncobj keeps the socket private; a version that renames it keeps TCP's defaults.
    sock = getattr(conn, "_TcpConnection__socket", None)
    if isinstance(sock, socket.socket):
        for_cluster(sock)


#: pysyncobj's private fields and methods that ``ElectionGatedSyncObj`` reads or sets.
_PRIVATE = ("_SyncObj__raftState", "_SyncObj__raftElectionDeadline", "_SyncObj__raftCurrentTerm",
            "_SyncObj__selfNode", "_SyncObj__otherNodes", "_SyncObj__transport",
            "_SyncObj__transferInProgress", "_SyncObj__connectedToAnyone",
            "_SyncObj__generateRaftTimeout", "_SyncObj__getCurrentLogTerm",
            "_SyncObj__getCurrentLogIndex", "_SyncObj__setCurrentTerm", "_SyncObj__setState",
            "_SyncObj__raftLeader")


#: The election deadline pysyncobj sees while the gate holds the real one: never due.
_HELD = float("inf")


class ElectionGatedSyncObj(SyncObj):
    """pysyncobj's node with pre-vote and the leader lease (``prevote.py``).

    Everything here runs on the Raft thread: ``_onTick`` before pysyncobj's own tick, and
    the transport's hooks inside its poll.  pysyncobj starts an election in its tick when
    the election deadline has passed; the gate runs first, keeps that deadline itself, and
    when it is due sends pre-votes instead, unless a pre-vote round has won (or a
    leadership transfer asked for the election): then it hands pysyncobj the due deadline
    and pysyncobj's tick starts the election as it always did.  A round that wins sets the
    deadline to zero, so the next tick campaigns.
    """

    def __init__(self, *args: Any, lease: float, **kwargs: Any) -> None:
        # Set before SyncObj.__init__: pysyncobj pickles attributes set after it into dumps,
        # and starts ticking (and calling the hooks below) before it returns.
        self.election_gate = ElectionGate(lease)
        self._transfer_vote_term: int | None = None
        self._deadline = 0.0  # the election deadline pysyncobj armed last (_gate_election)
        super().__init__(*args, **kwargs)
        missing = [name for name in _PRIVATE if not hasattr(self, name)]
        if missing:
            self.destroy()
            raise RuntimeError(f"this pysyncobj lacks {', '.join(missing)}: pre-vote needs "
                               "the version setup.cfg pins")

    def _log_position(self) -> LogPosition:
        return LogPosition(self._SyncObj__getCurrentLogTerm(),
                           self._SyncObj__getCurrentLogIndex())

    def _onTick(self, timeToWait: float = 0.0) -> None:
        if hasattr(self, "_SyncObj__otherNodes"):  # absent only on an unsupported version
            self._gate_election(monotonic())
        super()._onTick(timeToWait)

    def _gate_election(self, now: float) -> None:
        # pysyncobj keeps one election deadline, re-arms it on heartbeats and votes, and
        # checks it against its own clock later in the same tick.  A deadline falling
        # between the gate's clock reading and pysyncobj's (the tick flushes its journal
        # in between, once a second) would start an election no pre-vote had won.  So the
        # gate takes every deadline pysyncobj arms into ``_deadline`` and leaves it
        # ``_HELD`` (never due); it hands pysyncobj a due deadline only to campaign.
        armed = self._SyncObj__raftElectionDeadline
        if armed != _HELD:
            self._deadline = armed
            self._SyncObj__raftElectionDeadline = _HELD
        others = self._SyncObj__otherNodes
        if self._SyncObj__selfNode is None or not others:
            self._SyncObj__raftElectionDeadline = self._deadline  # no votes to ask for
            return
        if (self._SyncObj__raftState == _RAFT_STATE.LEADER or self._deadline >= now
                or not self._SyncObj__connectedToAnyone()):
            return  # no election is due on this tick
        gate = self.election_gate
        term = self._SyncObj__raftCurrentTerm
        if self._SyncObj__transferInProgress:
            self._transfer_vote_term = term + 1  # the leader asked: its lease must not refuse
            gate.campaign_started()
            self._SyncObj__raftElectionDeadline = self._deadline
            return
        if gate.may_campaign(term) and not gate.in_lease(now, False):
            self._transfer_vote_term = None
            gate.campaign_started()
            self._SyncObj__raftElectionDeadline = self._deadline
            return
        self._deadline = now + self._SyncObj__generateRaftTimeout()
        request = gate.start_round(term, self._log_position(), len(others) + 1,
                                   self._SyncObj__selfNode.id)
        transport = self._SyncObj__transport
        for node in others:
            transport.send(node, request.to_message())

    def screen_message(self, node: Any, message: Any) -> bool:
        """Handle pre-votes; say whether pysyncobj may see ``message`` (the lease drops
        vote requests); note the leader's append-entries for the lease."""
        kind = message.get("type") if isinstance(message, dict) else None
        if kind is None:
            return True
        gate = self.election_gate
        now = monotonic()
        term = self._SyncObj__raftCurrentTerm
        try:
            if kind == PRE_VOTE:
                answer = gate.answer(now, self._isLeader(), term, self._log_position(),
                                     PreVoteRequest.from_message(message))
                self._SyncObj__transport.send(node, answer.to_message())
                return False
            if kind == PRE_VOTE_RESPONSE:
                if (gate.on_response(node.id, PreVoteResponse.from_message(message))
                        and self._SyncObj__raftState != _RAFT_STATE.LEADER
                        and not gate.in_lease(now, False)):
                    self._SyncObj__raftElectionDeadline = 0  # campaign on the next tick
                return False
        except BadPreVoteMessage as exc:
            log.warning("raft: dropped a malformed pre-vote message from %s: %s", node.id, exc)
            return False
        if kind == "request_vote":
            return gate.admit_vote_request(now, self._isLeader(), message)
        if kind == "append_entries":
            leader_term = message.get("term")
            if isinstance(leader_term, int):
                if leader_term >= term:
                    gate.heard_from_leader(now)
                else:  # a leader behind our term: say so, or it never learns (STALE_TERM)
                    self._SyncObj__transport.send(node, {"type": STALE_TERM, "term": term})
            return True
        if kind == STALE_TERM:
            higher = message.get("term")
            if (isinstance(higher, int) and not isinstance(higher, bool) and higher > term
                    and self._SyncObj__selfNode is not None):
                log.warning("raft: %s is at term %d, ahead of ours (%d): stepping down so "
                            "that an election takes it along", node.id, higher, term)
                # What pysyncobj does on a vote request of a higher term.
                self._SyncObj__setCurrentTerm(higher, None)
                self._SyncObj__setState(_RAFT_STATE.FOLLOWER)
                self._SyncObj__raftLeader = None
            return False
        return True

    def tag_vote_request(self, message: Any) -> Any:
        """A vote request of the election a leadership transfer started says so."""
        if (isinstance(message, dict) and message.get("type") == "request_vote"
                and self._transfer_vote_term is not None
                and message.get("term") == self._transfer_vote_term):
            return {**message, TRANSFER_KEY: True}
        return message


class ReplicatedMetadata(SyncObjConsumer):
    """The replicated wrapper: ``apply`` runs on every node once the entry commits."""

    def __init__(self, on_applied: Callable[[MetadataState], None]) -> None:
        # Set before SyncObjConsumer.__init__ so that pysyncobj does not pickle it into dumps.
        self._on_applied = on_applied
        super().__init__()
        self.state = MetadataState()

    @replicated
    def apply(self, command: Command) -> Result:
        result = self.state.apply(command)
        self._on_applied(self.state)
        return result

    def _deserialize(self, data: Any) -> None:
        super()._deserialize(data)
        self._on_applied(self.state)


def raft_files(data_dir: Path) -> tuple[Path, Path]:
    raft_dir = data_dir / "raft"
    raft_dir.mkdir(parents=True, exist_ok=True)
    return raft_dir / "journal.bin", raft_dir / "dump.bin"


def make_syncobj(
    self_raft: str,
    peers: list[str],
    consumer: ReplicatedMetadata,
    password: str,
    data_dir: Path | None,
    timeouts: RaftTimeouts = DEFAULT_TIMEOUTS,
    on_state_changed: Callable[[int, int], None] | None = None,
) -> SyncObj:
    """Start a pysyncobj node (its thread starts here; the constructor blocks briefly)."""
    journal, dump = raft_files(data_dir) if data_dir is not None else (None, None)
    conf = SyncObjConf(
        # The address it is given, not pysyncobj's default of every interface: a node told
        # to use 127.0.0.1 (or one private interface) must not expose Raft beyond it.
        bindAddress=self_raft,
        password=password,
        useFork=False,
        dynamicMembershipChange=True,
        commandsWaitLeader=False,
        appendEntriesUseBatch=False,
        journalFile=None if journal is None else str(journal),
        fullDumpFile=None if dump is None else str(dump),
        appendEntriesPeriod=timeouts.append_entries_period,
        raftMinTimeout=timeouts.election_min,
        raftMaxTimeout=timeouts.election_max,
        connectionTimeout=timeouts.connection_timeout,
        connectionRetryTime=timeouts.connection_retry,
        leaderFallbackTimeout=timeouts.leader_fallback,
        logCompactionMinEntries=2000,
        logCompactionMinTime=60,
        onStateChanged=on_state_changed,
    )
    return ElectionGatedSyncObj(self_raft, [p for p in peers if p != self_raft], conf=conf,
                                consumers=[consumer], transportClass=TimelyTcpTransport,
                                lease=timeouts.election_min)


class RaftHost:
    """A dedicated thread that creates the SyncObj and outlives it.

    pysyncobj's tick thread stops as soon as the thread that constructed the SyncObj exits.
    Built on a trio worker thread (which trio retires when idle) Raft would silently stop
    ticking some seconds later; built on the trio thread it would block the loop during
    key derivation.  So one plain thread builds it, waits for ``stop()``, and destroys it.
    """

    def __init__(self, factory: Callable[[], SyncObj]) -> None:
        self._factory = factory
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._done = threading.Event()
        self.syncobj: SyncObj | None = None
        self.error: BaseException | None = None

    def _main(self) -> None:
        try:
            self.syncobj = self._factory()
        except BaseException as exc:
            self.error = exc
            self._done.set()
            return
        finally:
            self._ready.set()
        self._stop.wait()
        try:
            self.syncobj.destroy_synchronous()
        finally:
            self._done.set()

    def start(self) -> None:
        threading.Thread(target=self._main, name="raft-host", daemon=True).start()

    def wait_ready(self) -> SyncObj:
        """Blocking: call through ``trio.to_thread``."""
        self._ready.wait()
        if self.syncobj is None:
            raise RuntimeError("pysyncobj failed to start") from self.error
        return self.syncobj

    def stop(self) -> None:
        """Blocking: call through ``trio.to_thread``."""
        self._stop.set()
        self._done.wait()
