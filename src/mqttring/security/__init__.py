"""Who may connect and what they may touch: password files and ACLs in mosquitto's formats.

Pure parsers and decisions (``passwords``, ``acl``, ``ratelimit``) plus the holders the
broker core asks (``auth.Authenticator``, ``acl.AccessControl``), each with a ``reload()``
that reads its file into a new immutable value and swaps it in (docs/security.md).
"""

from __future__ import annotations

from mqttring.config import BrokerConfig
from mqttring.security.acl import AclFile
from mqttring.security.passwords import PasswordFile


def check_security_files(config: BrokerConfig) -> None:
    """Load the configured password and ACL files once, so that a missing or malformed one
    stops the node at start-up with a ``ConfigError`` naming the file and line."""
    if config.password_file is not None:
        PasswordFile.load(config.password_file)
    if config.acl_file is not None:
        AclFile.load(config.acl_file)
