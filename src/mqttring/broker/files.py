"""``NodeFiles``: everything a node reads from disk before it serves, loaded once.

A node process must refuse a missing or malformed password file, ACL file or certificate
with one line and exit code 2 *before* it sets up logging, opens its store or binds a port
(``mqttring.node``).  That means loading the files early; loading them again when the
broker is built would read each file twice and, if one changed in between, serve with
something other than what was checked.  So the process loads them once into a
``NodeFiles`` and hands it to ``MqttRingBroker``, whose parts take the loaded values
(``Authenticator``, ``AccessControl``, ``TlsContext``, the admin server's cluster TLS).
An embedding program that hands in nothing gets the same load at the start of ``serve``.

Reloads (SIGHUP) read the files again through each holder's ``reload()``: that is the point
of a reload, not a second load.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from mqttring.broker.tls import build_server_context, tls_enabled
from mqttring.cluster_tls import ClusterTls, cluster_tls
from mqttring.config import BrokerConfig
from mqttring.security.acl import AclFile
from mqttring.security.passwords import PasswordFile


@dataclass(frozen=True, slots=True)
class NodeFiles:
    """The loaded contents of the files ``config`` names (None: that file is not used)."""

    #: ``config.password_file``.
    passwords: PasswordFile | None
    #: ``config.acl_file``.
    acl: AclFile | None
    #: The TLS listeners' (``mqtts``, ``wss``) server context.
    tls: ssl.SSLContext | None
    #: Mutual TLS on the cluster (or admin) address.
    cluster_tls: ClusterTls | None

    @classmethod
    def load(cls, config: BrokerConfig) -> NodeFiles:
        """Blocking file I/O; a missing or malformed file raises ``ConfigError`` (one line
        naming the file, and the line for password and ACL files)."""
        return cls(
            passwords=None if config.password_file is None
            else PasswordFile.load(config.password_file),
            acl=None if config.acl_file is None else AclFile.load(config.acl_file),
            tls=build_server_context(config) if tls_enabled(config) else None,
            cluster_tls=cluster_tls(config),
        )


__all__ = ["NodeFiles"]
