"""Who may connect and what they may touch: password files and ACLs in mosquitto's formats.

Pure parsers and decisions (``passwords``, ``acl``, ``ratelimit``) plus the holders the
broker core asks (``auth.Authenticator``, ``acl.AccessControl``), each with a ``reload()``
that reads its file into a new immutable value and swaps it in (docs/security.md).
"""

from __future__ import annotations
