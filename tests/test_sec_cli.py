"""Operator commands given bad input answer with one ``error`` line and exit status 2, never
a traceback (real ``python -m mqttring.cli`` processes); ``mqttring cert ca`` gives every CA
a subject of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from mqttring.certs import CertError, make_ca, make_node_cert

pytestmark = pytest.mark.timeout(120)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mqttring.cli", *args], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "MQTTRING_CLUSTER_SECRET": "s3cret"})


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and not done.stdout
    return lines[0]


@pytest.mark.parametrize("address", ["nohost", "127.0.0.1:99999", "[::1]", "127.0.0.1:0",
                                     "host:port"])
@pytest.mark.parametrize("command", [("status",), ("leave",), ("pin", "a/b/#")])
def test_a_bad_node_address_is_one_line(address: str, command: tuple[str, ...]) -> None:
    line = one_error_line(cli(command[0], "--node", address, *command[1:]))
    assert line.startswith("error: --node: ") and repr(address) in line, line


def test_snapshot_with_a_bad_node_address_is_one_line(tmp_path: Path) -> None:
    for address in ("nohost", "127.0.0.1:99999"):
        line = one_error_line(cli("snapshot", "--node", address, "--out", str(tmp_path)))
        assert line.startswith("error: ") and repr(address) in line, line


@pytest.mark.parametrize("days", ["-5", "0", "36501", "99999999"])
def test_cert_days_out_of_range_are_refused(tmp_path: Path, days: str) -> None:
    """``--days 0`` used to make a certificate valid for five minutes; a negative count or
    a huge one a ValueError/OverflowError traceback."""
    line = one_error_line(cli("cert", "ca", str(tmp_path / "ca"), "--days", days))
    assert line == f"mqttring cert: --days must be 1 to 36500 (not {days})"
    assert not (tmp_path / "ca").exists()
    assert cli("cert", "ca", str(tmp_path / "good")).returncode == 0
    line = one_error_line(cli("cert", "node", str(tmp_path / "good"), "n1", "--days", days))
    assert line == f"mqttring cert: --days must be 1 to 36500 (not {days})"
    assert not (tmp_path / "good" / "n1.pem").exists()


def test_cert_days_bounds_are_usable(tmp_path: Path) -> None:
    for days in (1, 36500):
        pki = tmp_path / f"d{days}"
        make_ca(pki, days=days)
        cert_path, _ = make_node_cert(pki, "n", days=days)
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert lifetime.days == days  # plus the five minutes of clock skew before "now"
    with pytest.raises(CertError, match="--days must be 1 to 36500"):
        make_ca(tmp_path / "zero", days=0)


def test_every_ca_has_a_subject_of_its_own(tmp_path: Path) -> None:
    """Two clusters' CAs used to share ``CN=mqttring cluster CA``: a certificate or CRL of
    one was looked up under the other's name.  Each is its own now, and its node
    certificates name it as issuer."""
    subjects = set()
    for name in ("one", "two"):
        done = cli("cert", "ca", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        ca = x509.load_pem_x509_certificate((tmp_path / name / "ca.pem").read_bytes())
        assert ca.subject == ca.issuer
        cn = ca.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
        assert isinstance(cn, str) and cn.startswith("mqttring cluster CA ")
        subjects.add(ca.subject)
        assert cli("cert", "node", str(tmp_path / name), "n").returncode == 0
        node = x509.load_pem_x509_certificate((tmp_path / name / "n.pem").read_bytes())
        assert node.issuer == ca.subject
        node.verify_directly_issued_by(ca)
    assert len(subjects) == 2
