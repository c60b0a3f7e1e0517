"""What a reload of the login and ACL settings does to the clients already connected.

Apart from ``core.py`` because it is its own idea: a change of who may log in or of what a
client may do reaches connections that were let in under the old rules, the way mosquitto
2 applies a reload to every connected client (a black-box security probe, 2026-11-29,
found each case below left alone):

* **Logins.**  A connection is kept only if the new settings would let it in, judged
  without its password (none is kept): an anonymous one while ``allow_anonymous`` holds; one
  with a username, if there is no password file and anonymous clients are let in (a
  username proves nothing then), or if the new file has the very entry the old file had
  for it (the password it proved is still that user's).  So a password file added where
  there was none closes every username-only connection (an impostor's claim was never
  checked), ``allow_anonymous`` turned off closes the anonymous ones, and a user whose entry
  was removed or changed is closed as before.  A client its certificate logged in
  (``use_identity_as_username``) is not affected.  MQTT 5: DISCONNECT 0x87 (not authorized).
  Its will is not published: the identity it was given for is revoked (as mosquitto).
* **ACLs.**  Every session bound to a connection (here or, at a cluster home, on another
  node) gets the ACL's view of its client anew (``Session.access``) when the ACL file's
  path changes, to another file, to none or from none: before, a session kept the view it
  got at CONNECT, so a client connected before an ``acl_file`` was added went on without
  one.  (A reload of the same path swaps the rules inside the view, ``AccessControl``.)

``SecurityReload`` is a mixin of ``BrokerCore``: it holds no state of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from mqttring.config import ConfigError
from mqttring.security.auth import Authenticator

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler
    from mqttring.config import BrokerConfig
    from mqttring.protocol.session import Session
    from mqttring.security.acl import AccessControl, ClientAccess

log = logging.getLogger("mqttring.broker")


def refusal(old: Authenticator, new: Authenticator, username: str | None) -> str | None:
    """Why ``new`` would not let in a connection that ``old`` let in as ``username``,
    judged without its password (module docstring); None: it would."""
    after = new.passwords
    if username is None or after is None:
        if new.allow_anonymous:
            return None
        return ("anonymous clients are no longer let in" if username is None
                else f"user {username!r} logged in without a password file, and anonymous "
                     "clients are no longer let in")
    before = old.passwords
    if before is None:
        return (f"user {username!r} logged in before there was a password file: its "
                "username was never checked")
    entry = before.get(username)
    if entry is not None and after.get(username) == entry:
        return None
    return _REVOKED.format(who=f"user {username!r}")


#: Why a connection whose password-file entry changed is closed (the log line says it).
_REVOKED = "the password-file entry of {who} was removed or changed"


class SecurityReload:
    """Reloads of ``BrokerCore``'s ``auth`` and ``acl`` (module docstring)."""

    __slots__ = ()

    config: BrokerConfig
    auth: Authenticator
    acl: AccessControl | None
    sessions: dict[str, Session]
    clients: dict[str, ClientHandler]
    _trio_token: trio.lowlevel.TrioToken | None

    if TYPE_CHECKING:
        def access_for(self, username: str | None, client_id: str
                       ) -> ClientAccess | None: ...

    def reload_security(self) -> None:
        """Re-read the password file and the ACL file (the reload hook's call; SIGHUP).

        Each file is swapped in whole if it parses and left as it was if not; both are
        tried, then the first error (a ``ConfigError`` naming the file and line) is raised.
        It reads two small files: cheap, but a caller in the event loop may prefer
        ``trio.to_thread.run_sync(core.reload_security)`` (each swap is one assignment).

        A user whose password-file entry was removed or changed is disconnected from this
        node, as mosquitto 2 does (MQTT 5: DISCONNECT 0x87, not authorized; the close is
        logged with that reason): its old password no longer logs in, so neither may a
        connection it opened stay.  Only the entries are compared, no password is kept.
        A client whose certificate CN is its username (``use_identity_as_username``) is
        not affected.  The closes run on the event loop, from whichever thread this is.
        """
        errors: list[ConfigError] = []
        auth, revoked = self.auth, frozenset[str]()
        for holder in (auth, self.acl):
            if holder is None:
                continue
            try:
                changed = holder.reload()
            except ConfigError as exc:
                log.error("not reloaded, the previous rules stay in force: %s", exc)
                errors.append(exc)
            else:
                if holder is auth and changed:
                    revoked = changed
        if revoked:
            self._close_logins(lambda username: None if username not in revoked
                               else _REVOKED.format(who=f"user {username!r}"))
        if errors:
            raise errors[0]

    def security_changed(self, old_auth: Authenticator, old_acl: AccessControl | None
                         ) -> None:
        """``apply_settings`` swapped in ``self.auth``/``self.acl`` (either may be the old
        one): apply them to the connections let in before (module docstring)."""
        new_auth = self.auth
        if new_auth is not old_auth:
            self._close_logins(lambda username: refusal(old_auth, new_auth, username))
        if self.acl is not old_acl:
            self._on_loop(self._rebind_access)

    def _rebind_access(self) -> None:
        sessions = {id(s): s for s in self.sessions.values()}
        for handler in self.clients.values():  # a cluster edge's stand-ins too
            if handler.session is not None:
                sessions[id(handler.session)] = handler.session
        for session in sessions.values():
            if session.access is not None or session.online:
                session.access = self.access_for(session.username, session.client_id)

    def _close_logins(self, refused: Callable[[str | None], str | None]) -> None:
        """Close this node's connections whose login ``refused`` gives a reason for now
        (their wills not published), on the event loop, from whichever thread this is."""

        def disconnect() -> None:
            by_certificate = self.config.use_identity_as_username
            for handler in list(self.clients.values()):
                connect = handler.conn.connect
                if connect is None or (by_certificate and handler.transport.secure):
                    continue  # not logged in yet, or its certificate logged it in
                why = refused(connect.username)
                if why is not None:
                    handler.forfeit_will()
                    handler.kick(why, 0x87)  # MQTT 5: not authorized

        self._on_loop(disconnect)

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop this core serves, from whichever thread this is."""
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # a worker thread (SIGHUP) or an embedder's own thread
            try:
                if self._trio_token is not None:
                    trio.from_thread.run_sync(fn, trio_token=self._trio_token)
            except trio.RunFinishedError:
                pass  # the node stopped meanwhile: every connection is closed anyway
        else:
            fn()
