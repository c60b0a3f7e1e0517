"""Password files (``mqttring.security.passwords``), the failed-login limit and
``mqttring passwd``: golden entries made by the real ``mosquitto_passwd``, files we write read
by the real ``mosquitto_passwd`` and accepted by a real mosquitto broker."""

from __future__ import annotations

import base64
import contextlib
import json
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mosquitto_support import mosquitto
from mqttring.cli import main as cli
from mqttring.config import BrokerConfig, ConfigError
from mqttring.security.passwords import (
    PasswordFile,
    PasswordFileError,
    PasswordHash,
    hash_password,
)
from mqttring.security.ratelimit import FailureLimiter, source_address

pytestmark = pytest.mark.timeout(60)

#: ``mosquitto_passwd -c -b f alice secret`` (mosquitto 2.0.11): PBKDF2-SHA512, 101 rounds.
GOLDEN_7 = ("alice:$7$101$0DFnO3FjseuMDGFa$KGgLA/lQR0MZn+b0/EqLD0cgMCyR9HY3c45X79smtgLDmIULwSn"
            "/Q7/X+DbvbW70f1B0w1C93ymOYiQVRPjsCw==")
#: ``mosquitto_passwd -H sha512 -c -b f bob pw``: salted SHA-512 of mosquitto <= 1.6.
GOLDEN_6 = ("bob:$6$P+dvU6fgVQCYQQ74$+VgjDTP/OLfq6lv/esXOEBGLi0Nc4wvnVHRJop6rN5uydZn3jAp3SpD/"
            "iNRyQjjJxwsFRhvWi424pr/IR4ieNw==")


def test_golden_entries_from_mosquitto_passwd_verify():
    pw = PasswordFile.parse(f"# made by mosquitto_passwd\n\n{GOLDEN_7}\n{GOLDEN_6}\n")
    alice, bob = pw.get("alice"), pw.get("bob")
    assert alice is not None and bob is not None
    assert (alice.kind, alice.iterations, len(alice.salt), len(alice.digest)) == (7, 101, 12, 64)
    assert alice.verify(b"secret") and not alice.verify(b"Secret")
    assert bob.verify(b"pw") and not bob.verify(b"pw ")
    assert pw.get("carol") is None
    # Encoding round-trips byte for byte.
    assert f"alice:{alice.encode()}" == GOLDEN_7 and f"bob:{bob.encode()}" == GOLDEN_6


def test_our_hash_is_mosquittos_derivation():
    salt = PasswordHash.parse(GOLDEN_7.split(":", 1)[1]).salt
    assert f"alice:{hash_password(b'secret', salt=salt).encode()}" == GOLDEN_7


#: A well-formed SHA-512 output (64 bytes) for entries whose other fields are under test.
FULL_DIGEST = base64.b64encode(bytes(range(64))).decode()


@pytest.mark.parametrize(("text", "where"), [
    (f"{GOLDEN_7}\nbob\n", ":2: expected username:hash"),
    ("alice:plaintext\n", ":1: user 'alice': the password is not hashed"),
    ("alice:$5$abc$def\n", "unknown hash type $5$"),
    ("alice:$7$x$AAAA$AAAA\n", "malformed hash"),
    ("alice:$7$101$!!!$AAAA\n", "malformed hash"),
    ("# c\nalice:$6$AAAA$AAAA\n", ":2: user 'alice': malformed hash"),
    # The same user twice: which password was meant?  Refused, not "the last one wins".
    (f"{GOLDEN_7}\n# c\n{GOLDEN_7.replace('101', '102', 1)}\n",
     ":3: user 'alice' again (first on line 1)"),
    # An absurd iteration count would crash every login (OverflowError) if it loaded.
    ("big:$7$99999999999999999999$mZreJ/mvSbx7ktpR$AAAA\n",
     ":1: user 'big': malformed hash: iterations must be 1 to 10,000,000"),
    ("big:$7$10000001$mZreJ/mvSbx7ktpR$AAAA\n", "iterations must be 1 to 10,000,000"),
    ("zero:$7$0$mZreJ/mvSbx7ktpR$AAAA\n", "iterations must be 1 to 10,000,000"),
    ("neg:$7$-5$mZreJ/mvSbx7ktpR$AAAA\n", "iterations '-5' is not a number"),
    # A truncated hash let in every password whose hash starts with it (1 byte: 1 guess in
    # 256), an empty one made every login of the user an internal error; an empty salt.
    ("dave:$7$101$AAAA$AA==\n", ":1: user 'dave': malformed hash: a $7$ hash must be 64 bytes "
     "(not 1)"),
    ("erin:$7$101$AAAA$\n", "a $7$ hash must be 64 bytes (not 0)"),
    ("erin:$6$AAAA$\n", "a $6$ hash must be 64 bytes (not 0)"),
    (f"salty:$7$101$${FULL_DIGEST}\n", ":1: user 'salty': malformed hash: the salt is empty"),
    (f"salty:$6$${FULL_DIGEST}\n", "the salt is empty"),
])
def test_a_bad_line_is_a_typed_error_naming_it(text, where):
    with pytest.raises(PasswordFileError) as err:
        PasswordFile.parse(text, "pw")
    assert where in str(err.value) and isinstance(err.value, ConfigError)


def test_the_iteration_bound_itself_loads():
    from mqttring.security.passwords import MAX_ITERATIONS

    entry = PasswordFile.parse(f"u:$7${MAX_ITERATIONS}$mZreJ/mvSbx7ktpR${FULL_DIGEST}\n").get("u")
    assert entry is not None and entry.iterations == MAX_ITERATIONS == 10_000_000


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(PasswordFileError, match="cannot read password file"):
        PasswordFile.load(tmp_path / "nope")


def test_users_table_is_refused_with_how_to_migrate():
    with pytest.raises(ConfigError, match=r"mqttring passwd -c -b FILE USER PASSWORD"):
        BrokerConfig.from_mapping({"users": {"alice": "00"}})


def test_failure_limiter_token_bucket_and_bounded_memory():
    lim = FailureLimiter(burst=3, window=30.0, max_addresses=2)  # one token per 10 s

    def fail(addr: str, now: float) -> bool:
        assert lim.begin(addr, now)
        return lim.end(addr, now, failed=True)

    assert not lim.blocked("a", 0.0)
    assert not fail("a", 0.0) and not fail("a", 0.0)
    assert fail("a", 0.0), "the third failure uses the budget up"
    assert lim.blocked("a", 1.0) and not lim.blocked("b", 1.0)
    assert not lim.begin("a", 1.0), "refused unchecked"
    assert not lim.blocked("a", 10.5), "a token came back after 10 s"
    assert not fail("a", 10.5), "used up again: already announced"
    assert not lim.blocked("a", 100.0) and len(lim) == 0, "refilled entries are forgotten"
    assert fail("a", 100.0) is False and len(lim) == 1
    assert lim.begin("a", 100.0) and not lim.end("a", 100.0, failed=False)
    for addr in ("x", "y", "z"):
        fail(addr, 200.0)
    assert len(lim) == 2, "memory is bounded"
    off = FailureLimiter(burst=0, window=1.0)
    assert all(off.begin("a", 0.0) for _ in range(100)) and not off.blocked("a", 0.0)
    assert not any(off.end("a", 0.0, failed=True) for _ in range(100))
    assert source_address("127.0.0.1:5555") == "127.0.0.1"
    assert source_address("ws:[::1]:80") == "ws:[::1]"


def test_a_login_being_verified_holds_a_failure_of_the_budget():
    """Logins verified at once count against the budget as they begin, not as they end:
    50 concurrent wrong passwords against a budget of 10 had 31 verified (a black-box
    probe), the bucket far below zero and the warning logged 17 times."""
    lim = FailureLimiter(burst=10, window=60.0)
    let_in = [lim.begin("a", 0.0) for _ in range(50)]
    assert let_in.count(True) == 10
    announced = [lim.end("a", 1.0, failed=True) for _ in range(10)]
    assert announced.count(True) == 1
    assert not lim.blocked("a", 7.0), "one window's share back after 6 s: never below zero"
    ok = FailureLimiter(burst=2, window=60.0)
    for _ in range(5):  # successes give their token back
        assert ok.begin("b", 0.0) and not ok.end("b", 0.0, failed=False)
    assert len(ok) == 0


async def test_concurrent_wrong_logins_verify_at_most_the_budget(tmp_path, caplog):
    import logging

    import trio

    from mqttring.security.auth import Authenticator, AuthOutcome

    pw = tmp_path / "pw"
    pw.write_text(f"alice:{hash_password(b'right', iterations=101).encode()}\n")
    auth = Authenticator(allow_anonymous=False, password_file=pw, failures_allowed=10,
                         failure_window=60.0)
    outcomes: list[AuthOutcome] = []

    async def attempt(i: int) -> None:
        outcomes.append(await auth.check("alice", f"wrong{i}".encode(), "10.0.0.1:5000"))

    with caplog.at_level(logging.WARNING, logger="mqttring.security"):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(attempt, i)
    assert outcomes.count(AuthOutcome.BAD_CREDENTIALS) == 10
    assert outcomes.count(AuthOutcome.RATE_LIMITED) == 40
    assert sum("failed logins from 10.0.0.1" in r.message for r in caplog.records) == 1
    assert await auth.check("alice", b"right", "10.0.0.2:5000") is AuthOutcome.ACCEPTED


# --------------------------------------------------------------------------- mqttring passwd


def passwd(*args: str) -> int:
    return cli(["passwd", *args])


def test_passwd_create_update_delete_and_mosquitto_reads_it(tmp_path, capsys):
    f = tmp_path / "pw"
    assert passwd("-c", "-b", str(f), "alice", "one") == 0
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert passwd("-b", str(f), "bob", "two") == 0
    assert passwd("-b", str(f), "alice", "three") == 0  # update in place
    pw = PasswordFile.load(f)
    assert [line.split(":")[0] for line in f.read_text().splitlines()] == ["alice", "bob"]
    assert pw.get("alice").verify(b"three") and pw.get("bob").verify(b"two")
    # The real mosquitto_passwd reads our file (it refuses a corrupt one) and adds to it.
    done = subprocess.run(["mosquitto_passwd", "-b", str(f), "carol", "four"],
                          capture_output=True, timeout=10)
    assert done.returncode == 0, done.stderr
    assert PasswordFile.load(f).get("carol").verify(b"four")
    assert passwd("-D", str(f), "bob") == 0
    assert PasswordFile.load(f).get("bob") is None
    assert passwd("-D", str(f), "bob") == 1
    assert "not found" in capsys.readouterr().err
    assert passwd("-c", "-b", str(f), "dave", "five") == 0
    assert list(PasswordFile.load(f).entries) == ["dave"], "-c overwrites"


def test_passwd_errors_are_one_line(tmp_path, capsys):
    f = tmp_path / "pw"
    assert passwd("-b", str(f), "alice", "x") == 1  # no -c: the file must exist
    assert "cannot open password file" in capsys.readouterr().err
    assert passwd("-c", "-b", str(f), "a:b", "x") == 1
    assert "':'" in capsys.readouterr().err
    f.write_text("alice:plain\n")
    assert passwd("-b", str(f), "bob", "x") == 1
    err = capsys.readouterr().err
    assert "pw:1" in err and "Traceback" not in err
    assert f.read_text() == "alice:plain\n", "a file we cannot read is left alone"


@pytest.mark.parametrize("user", ["#c\nadmin", "x\ny", "a\rb", "tab\tbed", "del\x7f",
                                  "nul\x00", "esc\x1b[1m", "sep\u2028x", "c1\x85x"])
def test_passwd_refuses_control_characters_in_the_username(tmp_path, capsys, user):
    """A newline in the username would write a line of the caller's choosing into the
    file (an entry, or a comment hiding the next one): refused as mosquitto_passwd does,
    and the file is left as it was."""
    f = tmp_path / "pw"
    assert passwd("-c", "-b", str(f), "alice", "one") == 0
    before = f.read_bytes()
    for args in (["-b", str(f), user, "pwned"], ["-c", "-b", str(f), user, "pwned"],
                 ["-D", str(f), user]):
        assert passwd(*args) == 1
        err = capsys.readouterr().err
        assert err == ("mqttring passwd: error: username must not contain control "
                       "characters\n"), err
        assert f.read_bytes() == before
    assert list(PasswordFile.load(f).entries) == ["alice"]


@pytest.mark.parametrize(("user", "why"), [
    ("#m", "must not start with '#'"), (" sp", "must not start or end with whitespace"),
    ("sp ", "must not start or end with whitespace"),
    ("u\udcff", "username must be UTF-8"),  # a non-UTF-8 byte of the command line
])
def test_passwd_refuses_names_the_file_would_read_otherwise(tmp_path, capsys, user, why):
    """"#m" was written as a comment (no such user), " sp" as the password of "sp" (the
    loader strips the line), a non-UTF-8 name ended in a traceback (a black-box probe)."""
    f = tmp_path / "pw"
    assert passwd("-c", "-b", str(f), "alice", "one") == 0
    before = f.read_bytes()
    assert passwd("-b", str(f), user, "pw") == 1
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err
    assert f.read_bytes() == before


def test_passwd_takes_a_password_that_is_not_utf8(tmp_path):
    """The command line's bytes as given (MQTT passwords are binary): a traceback before."""
    f = tmp_path / "pw"
    assert passwd("-c", "-b", str(f), "u1", "\udcff\udcfe") == 0  # argv bytes ff fe
    entry = PasswordFile.load(f).get("u1")
    assert entry is not None and entry.verify(b"\xff\xfe")


def test_passwd_iterations_are_bounded(tmp_path, capsys):
    f = tmp_path / "pw"
    for bad in ("0", "10000001", "many"):
        with pytest.raises(SystemExit) as done:
            passwd("-c", "-b", "-I", bad, str(f), "alice", "one")
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "iterations must be" in err and "Traceback" not in err
    assert not f.exists()
    assert passwd("-c", "-b", "-I", "1000", str(f), "alice", "one") == 0
    assert PasswordFile.load(f).get("alice").iterations == 1000


def test_passwd_prompts_twice(tmp_path, monkeypatch, capsys):
    f = tmp_path / "pw"
    answers = iter(["s3cret", "s3cret", "a", "b"])
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    assert passwd("-c", str(f), "alice") == 0
    assert PasswordFile.load(f).get("alice").verify(b"s3cret")
    assert passwd(str(f), "alice") == 1
    assert "do not match" in capsys.readouterr().err
    assert PasswordFile.load(f).get("alice").verify(b"s3cret")


def _mosquitto(tmp_path: Path, password_file: Path) -> contextlib.AbstractContextManager[int]:
    """A real mosquitto broker using ``password_file`` (no anonymous clients); its port."""
    return mosquitto(tmp_path, f"allow_anonymous false\npassword_file {password_file}\n")


@contextlib.contextmanager
def _our_node(tmp_path: Path, password_file: Path) -> Iterator[int]:
    """A real ``python -m mqttring.node`` using ``password_file``; its MQTT port."""
    ready = tmp_path / "node-ready.json"
    out = tmp_path / "node.out"
    with out.open("wb") as sink:
        node = subprocess.Popen(
            [sys.executable, "-m", "mqttring.node", "--mqtt", "127.0.0.1:0", "--data-dir",
             str(tmp_path / "node-data"), "--password-file", str(password_file),
             "--ready-file", str(ready), "--sys-interval", "0"],
            stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():  # bounded: until the node listens
            assert node.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        yield json.loads(ready.read_text())["mqtt"]
    finally:
        node.kill()
        node.wait(10)


def _pub(port: int, user: str, password: str) -> int:
    return subprocess.run(
        ["mosquitto_pub", "-p", str(port), "-u", user, "-P", password, "-t", "t", "-m", "x"],
        capture_output=True, timeout=15).returncode


def test_a_real_mosquitto_broker_accepts_our_file(tmp_path):
    f = tmp_path / "pw"
    assert passwd("-c", "-b", str(f), "alice", "s3cret") == 0
    with _mosquitto(tmp_path, f) as port:
        assert _pub(port, "alice", "s3cret") == 0
        assert _pub(port, "alice", "wrong") != 0


#: Plain-text lines for ``-U``, as ``mosquitto_passwd -U`` takes them (whitespace around the
#: user and the password is not part of them).
PLAIN = "alice:s3cret\n  bob : two words  \ncarol:\u00e9t\u00e9\n"
#: What each user's password then is.
PLAIN_PASSWORDS = {"alice": "s3cret", "bob": "two words", "carol": "\u00e9t\u00e9"}


def test_passwd_upgrade_hashes_plain_lines_as_mosquitto_passwd_does(tmp_path, capsys):
    """``-U FILE`` (was: "the following arguments are required: username").  Our result and
    the real ``mosquitto_passwd -U``'s verify the same passwords; where mosquitto's would
    damage the file, ours does not: comments and blank lines are kept (mosquitto refuses
    the file), an entry already hashed is kept (mosquitto hashes the hash: locked out), a
    password holding ':' is kept whole (mosquitto cuts it at the second ':')."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.write_text(PLAIN)
    theirs.write_text(PLAIN)
    assert passwd("-U", str(ours)) == 0
    done = subprocess.run(["mosquitto_passwd", "-U", str(theirs)], capture_output=True,
                          timeout=10)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(ours.stat().st_mode) == 0o600
    for path in (ours, theirs):
        loaded = PasswordFile.load(path)
        assert list(loaded.entries) == list(PLAIN_PASSWORDS)
        for user, password in PLAIN_PASSWORDS.items():
            entry = loaded.get(user)
            assert entry is not None and entry.kind == 7 and entry.iterations == 101
            assert entry.verify(password.encode()), (path.name, user)
            assert not entry.verify(b"wrong")
    # What mosquitto_passwd -U would damage.
    f = tmp_path / "mixed"
    assert passwd("-c", "-b", str(f), "dave", "hashed-before") == 0
    dave_line = f.read_text()
    f.write_text(f"# our users\n\n{dave_line}erin:a:b:c\n")
    capsys.readouterr()
    assert passwd("-U", "-I", "1000", str(f)) == 0
    assert "1 user(s) hashed already, left as they are: dave" in capsys.readouterr().err
    lines = f.read_text().splitlines()
    assert lines[:3] == ["# our users", "", dave_line.strip()]
    loaded = PasswordFile.load(f)
    assert loaded.get("dave").verify(b"hashed-before")
    assert loaded.get("erin").verify(b"a:b:c") and loaded.get("erin").iterations == 1000
    before = f.read_bytes()
    assert passwd("-U", str(f)) == 0, "-U twice: nothing to hash"
    assert f.read_bytes() == before


@pytest.mark.parametrize(("text", "args", "error"), [
    ("alice:x\ncarol\n", (), ":2: expected username:password (nothing changed)"),
    ("alice:x\ndave:  \n", (), ":2: expected username:password"),
    ("alice:x\nalice:y\n", (), ":2: user 'alice' again (first on line 1)"),
    ("#x:y\nal\x1bice:x\n", (), ":2: username must not contain control characters"),
    ("alice:x\n", ("-c",), "-c and -U cannot be used together"),
    ("alice:x\n", ("-D",), "-D and -U cannot be used together"),
    ("alice:x\n", ("-b",), "-b and -U cannot be used together"),
    ("alice:x\n", ("+user",), "-U takes the password file only"),
])
def test_passwd_upgrade_refuses_what_it_cannot_hash_and_changes_nothing(tmp_path, capsys,
                                                                         text, args, error):
    f = tmp_path / "pw"
    f.write_text(text)
    flags = [a for a in args if not a.startswith("+")]
    extra = [a[1:] for a in args if a.startswith("+")]
    assert passwd(*flags, "-U", str(f), *extra) == 1
    err = capsys.readouterr().err
    assert err.startswith("mqttring passwd: error: ") and error in err, err
    assert len(err.strip().splitlines()) == 1 and f.read_text() == text


def test_passwd_upgrade_of_a_missing_file_is_one_line(tmp_path, capsys):
    assert passwd("-U", str(tmp_path / "nope")) == 1
    assert "cannot open password file" in capsys.readouterr().err


def test_a_real_mosquitto_broker_and_our_node_accept_an_upgraded_file(tmp_path):
    """The upgraded file, as used: a real mosquitto broker and a real node let each user
    in with the password of its plain-text line, and no one with another."""
    f = tmp_path / "pw"
    f.write_text(f"# upgraded from plain text\n{PLAIN}")
    assert passwd("-U", str(f)) == 0
    for serve in (_mosquitto, _our_node):
        with serve(tmp_path, f) as port:
            for user, password in PLAIN_PASSWORDS.items():
                assert _pub(port, user, password) == 0, (serve.__name__, user)
            assert _pub(port, "alice", "two words") != 0, serve.__name__


def test_node_refuses_to_start_on_a_bad_password_file(tmp_path: Path):
    bad = tmp_path / "pw"
    bad.write_text("alice:$7$101$AAAA\n")
    done = subprocess.run([sys.executable, "-m", "mqttring.node", "--mqtt", "127.0.0.1:0",
                           "--data-dir", str(tmp_path / "d"), "--password-file", str(bad)],
                          capture_output=True, timeout=30)
    assert done.returncode == 2
    err = done.stderr.decode()
    assert "configuration error" in err and f"{bad}:1" in err and "Traceback" not in err
    bad.write_text("big:$7$99999999999999999999$mZreJ/mvSbx7ktpR$088+pIFz1z4taiNRuYtdL0PcD"
                   "ondD0eZcBNREs5Z02XiXFeQLlUx4riwfuaH3gcHyzGTiz9toXQ6Cxl2kAW5jA==\n")
    done = subprocess.run([sys.executable, "-m", "mqttring.node", "--mqtt", "127.0.0.1:0",
                           "--data-dir", str(tmp_path / "d"), "--password-file", str(bad)],
                          capture_output=True, timeout=30)
    err = done.stderr.decode()
    assert done.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{bad}:1: user 'big'" in err and "iterations must be 1 to 10,000,000" in err


# --------------------------------------------------------------------------- Authenticator


def test_authenticator_outcomes_cache_reload_and_limit(tmp_path):
    import trio

    from mqttring.security.auth import Authenticator, AuthOutcome
    from mqttring.security.passwords import format_entries

    f = tmp_path / "pw"
    f.write_text(format_entries([("alice", hash_password(b"one"))]))
    now = [0.0]
    auth = Authenticator(allow_anonymous=False, password_file=f, failures_allowed=2,
                         failure_window=60.0, clock=lambda: now[0])

    async def main() -> None:
        check = auth.check
        assert await check(None, None, "1.1.1.1:1") is AuthOutcome.NOT_AUTHORIZED
        assert await check("alice", b"one", "1.1.1.1:1") is AuthOutcome.ACCEPTED
        assert await check("alice", b"one", "1.1.1.1:2") is AuthOutcome.ACCEPTED  # cached
        # A changed file takes effect at reload, cached success or not.
        f.write_text(format_entries([("alice", hash_password(b"two"))]))
        auth.reload()
        assert await check("alice", b"one", "1.1.1.1:3") is AuthOutcome.BAD_CREDENTIALS
        assert await check("alice", b"two", "1.1.1.1:4") is AuthOutcome.ACCEPTED
        # A file that does not parse keeps the old one in force.
        f.write_text("alice:nonsense\n")
        with pytest.raises(PasswordFileError):
            auth.reload()
        assert await check("alice", b"two", "2.2.2.2:1") is AuthOutcome.ACCEPTED
        # Two failures from 1.1.1.1 (one above) use its budget: refused unchecked.
        assert await check("bob", b"x", "1.1.1.1:5") is AuthOutcome.BAD_CREDENTIALS
        assert await check("alice", b"two", "1.1.1.1:6") is AuthOutcome.RATE_LIMITED
        assert await check("alice", b"two", "2.2.2.2:2") is AuthOutcome.ACCEPTED
        now[0] = 31.0  # one token back (2 per 60 s)
        assert await check("alice", b"two", "1.1.1.1:7") is AuthOutcome.ACCEPTED

    trio.run(main)
    # No password field is not an empty password (mosquitto refuses it too).
    f.write_text(format_entries([("svc", hash_password(b"")), ("alice", hash_password(b"x"))]))
    assert auth.reload() == {"alice"}, "whose entry changed (the broker closes their logins)"
    f.write_text("".join(f"{line}\n" for line in reversed(f.read_text().splitlines())))
    assert auth.reload() == set(), "the same entries, in another order"
    now[0] = 1000.0

    async def empty() -> None:
        assert await auth.check("svc", b"", "3.3.3.3:1") is AuthOutcome.ACCEPTED
        assert await auth.check("svc", None, "3.3.3.3:2") is AuthOutcome.BAD_CREDENTIALS
        assert await auth.check("alice", None, "3.3.3.3:3") is AuthOutcome.BAD_CREDENTIALS

    trio.run(empty)
    anon = Authenticator(allow_anonymous=True)
    assert trio.run(anon.check, "anyone", b"x", "h:1") is AuthOutcome.ACCEPTED
