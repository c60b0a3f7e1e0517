"""``mqttring passwd``: manage a password file the way ``mosquitto_passwd`` does.

``-c`` creates (or overwrites) the file, ``-D`` deletes a user, ``-b`` takes the password
from the command line (batch), otherwise it is asked for twice without echo.  ``-U FILE``
upgrades a file of plain-text ``username:password`` lines to hashed ones, in place
(``upgrade``).  The file is replaced atomically with mode 0600, so a node reloading it never
sees half a file.  Lines of other users (and comments) are kept as they were.
"""

from __future__ import annotations

import argparse
import getpass
import sys
import unicodedata
from pathlib import Path

from mqttring.security.passwords import (
    DEFAULT_ITERATIONS,
    MAX_ITERATIONS,
    PasswordFile,
    PasswordFileError,
    PasswordHash,
    hash_password,
    write_atomically,
)


class PasswdError(Exception):
    """What the operator asked for cannot be done; the message says why."""


def _edit(lines: list[str], user: str, new_line: str | None) -> tuple[list[str], bool]:
    """``lines`` with ``user``'s entry replaced by ``new_line`` (None: removed, absent:
    appended); and whether the user had an entry."""
    out: list[str] = []
    found = False
    for line in lines:
        if line.partition(":")[0].strip() == user and not line.lstrip().startswith("#"):
            found = True
            if new_line is not None:
                out.append(new_line)
            continue
        out.append(line)
    if not found and new_line is not None:
        out.append(new_line)
    return out, found


def _ask_password() -> str:
    first = getpass.getpass("Password: ")
    second = getpass.getpass("Reenter password: ")
    if first != second:
        raise PasswdError("passwords do not match")
    return first


def check_username(user: str) -> None:
    """``PasswdError`` for a name the file cannot hold as one ``user:hash`` line: empty,
    with ``:`` (the separator), or with a control or line-separator character (a newline
    would write a second line: an entry of the caller's choosing, or a comment that hides
    one), as ``mosquitto_passwd`` refuses."""
    if not user:
        raise PasswdError("username must not be empty")
    if ":" in user:
        raise PasswdError("username must not contain the ':' character")
    if any(unicodedata.category(char) in ("Cc", "Zl", "Zp") for char in user):
        raise PasswdError("username must not contain control characters")
    try:
        user.encode()
    except UnicodeEncodeError:  # bytes of the command line that are not UTF-8
        raise PasswdError("username must be UTF-8 (an MQTT username is)") from None
    # Lines the loader reads as something else: a comment, or a name it strips.
    if user.startswith("#"):
        raise PasswdError("username must not start with '#' (the line would be a comment)")
    if user != user.strip():
        raise PasswdError("username must not start or end with whitespace")


def update(path: Path, user: str, password: str | None, *, create: bool = False,
           delete: bool = False, iterations: int = DEFAULT_ITERATIONS) -> bool:
    """Apply one change to the file; False when ``delete`` found no such user."""
    check_username(user)
    if create:
        lines: list[str] = []
    else:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise PasswdError(f"cannot open password file {path}: {exc}") from None
        PasswordFile.parse(text, str(path))  # refuse to rewrite a file we cannot read
        lines = text.splitlines()
    new_line = None
    if not delete:
        assert password is not None
        # An MQTT password is bytes: the command line's, as given, even when not UTF-8
        # (they reach Python as surrogates; mosquitto_passwd takes them too).
        secret = password.encode("utf-8", "surrogateescape")
        new_line = f"{user}:{hash_password(secret, iterations=iterations).encode()}"
    lines, found = _edit(lines, user, new_line)
    write_atomically(path, "".join(f"{line}\n" for line in lines))
    return found or not delete


def upgrade(path: Path, *, iterations: int = DEFAULT_ITERATIONS) -> list[str]:
    """``mosquitto_passwd -U``: hash every plain-text ``username:password`` line of the file
    in place; the users whose line was already hashed (left as it is, and returned).

    As ``mosquitto_passwd -U``: the user and the password are taken with the whitespace
    around them removed, and a line without ``:`` or with an empty password is refused,
    naming its line (nothing is written).  Where it would damage the file, this does not:
    an entry that is already a valid hash is kept (mosquitto hashes the hash, which locks
    the user out, as its man page warns), a password holding ``:`` is kept whole (mosquitto
    keeps what comes before the second ``:``), and blank and ``#`` lines are kept (mosquitto
    refuses the file).  A name ``check_username`` refuses, or a user twice, is refused too.
    The result is checked to load (``PasswordFile.parse``) before it replaces the file.
    """
    try:
        # Password bytes as they are, UTF-8 or not (MQTT passwords are binary).
        text = path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        raise PasswdError(f"cannot open password file {path}: {exc}") from None
    out: list[str] = []
    kept: list[str] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            out.append(raw)
            continue
        user, sep, password = (part.strip() for part in line.partition(":"))
        where = f"{path}:{number}"
        if not sep or not password:
            raise PasswdError(f"{where}: expected username:password (nothing changed)")
        try:
            check_username(user)
        except PasswdError as exc:
            raise PasswdError(f"{where}: {exc} (nothing changed)") from None
        if user in seen:
            raise PasswdError(f"{where}: user {user!r} again (first on line {seen[user]}): "
                              "keep one entry per user (nothing changed)")
        seen[user] = number
        try:
            PasswordHash.parse(password)
        except ValueError:
            secret = password.encode("utf-8", "surrogateescape")
            out.append(f"{user}:{hash_password(secret, iterations=iterations).encode()}")
        else:
            kept.append(user)
            out.append(f"{user}:{password}")
    new = "".join(f"{line}\n" for line in out)
    PasswordFile.parse(new, str(path))  # what a node (and mosquitto) will load
    if len(kept) < len(seen):  # something was hashed
        write_atomically(path, new)
    return kept


def run(args: argparse.Namespace) -> int:
    if args.upgrade:
        return _run_upgrade(args)
    if args.username is None:
        args.parser.error("the following arguments are required: username")
    try:
        if args.create and args.delete:
            raise PasswdError("-c and -D cannot be used together")
        if args.batch and args.delete:
            raise PasswdError("-b and -D cannot be used together")
        if args.batch:
            if args.password is None:
                raise PasswdError("-b needs FILE USERNAME PASSWORD")
            password: str | None = args.password
        elif args.password is not None:
            raise PasswdError("a password on the command line needs -b")
        else:
            password = None if args.delete else _ask_password()
        if not update(args.file, args.username, password, create=args.create,
                      delete=args.delete, iterations=args.iterations):
            print(f"mqttring passwd: warning: user {args.username} not found in "
                  f"{args.file}", file=sys.stderr)
            return 1
    except (PasswdError, PasswordFileError) as exc:
        print(f"mqttring passwd: error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, EOFError):
        print(file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"mqttring passwd: error: cannot write {args.file}: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_upgrade(args: argparse.Namespace) -> int:
    try:
        for flag, given in (("-c", args.create), ("-b", args.batch), ("-D", args.delete)):
            if given:
                raise PasswdError(f"{flag} and -U cannot be used together")
        if args.username is not None:
            raise PasswdError("-U takes the password file only (it hashes every user's line)")
        kept = upgrade(args.file, iterations=args.iterations)
        if kept:  # mosquitto_passwd would have hashed their hashes: say why not, once
            names = ", ".join(kept[:5]) + (", ..." if len(kept) > 5 else "")
            print(f"mqttring passwd: {len(kept)} user(s) hashed already, left as they are: "
                  f"{names}", file=sys.stderr)
    except (PasswdError, PasswordFileError) as exc:
        print(f"mqttring passwd: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"mqttring passwd: error: cannot write {args.file}: {exc}", file=sys.stderr)
        return 1
    return 0


def _iterations(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"iterations must be a number, not {text!r}") from None
    if not 1 <= value <= MAX_ITERATIONS:
        raise argparse.ArgumentTypeError(f"iterations must be 1 to {MAX_ITERATIONS}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "passwd", help="add, update or delete a user in a password file (as mosquitto_passwd)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", dest="create", action="store_true",
                        help="create a new password file, overwriting an existing one")
    parser.add_argument("-b", dest="batch", action="store_true",
                        help="batch mode: the password is the last argument")
    parser.add_argument("-D", dest="delete", action="store_true",
                        help="delete the user instead of adding or updating it")
    parser.add_argument("-I", dest="iterations", type=_iterations,
                        default=DEFAULT_ITERATIONS,
                        help=f"PBKDF2 iterations (default {DEFAULT_ITERATIONS}, as mosquitto; "
                        f"at most {MAX_ITERATIONS})")
    parser.add_argument("-U", dest="upgrade", action="store_true",
                        help="upgrade a file of plain-text username:password lines to "
                        "hashed ones, in place (FILE only)")
    parser.add_argument("file", type=Path, help="the password file")
    parser.add_argument("username", nargs="?", help="the user (all but -U)")
    parser.add_argument("password", nargs="?", help="with -b only")
    parser.set_defaults(func=run, parser=parser)
