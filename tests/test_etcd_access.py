"""A real ``quiver coordinator --etcd`` reaching a real etcd the way a production one is
set up: over TLS with a client certificate (--client-cert-auth), and as an etcd user
where auth is enabled. It leads and writes its state; without its certificate, trusting
another CA, or with a wrong password, it never leads, and says why in one log line; a
token etcd forgot (etcd restarted) is replaced by a new one."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from quiverfs.bench.etcd_process import PREFIX, Etcd, EtcdTls, etcd_available
from quiverfs.bench.processes import CoordinatorProcess
from tests.etcd_tls import make_tls
from tests.mountd_helpers import wait_for
from tests.test_coordinator_ha import TTL, beat, coordinator, log_of, role

PASSWORD = "s3cret-of-quiver"


@pytest.fixture
def tls(tmp_path) -> EtcdTls:
    return make_tls(str(tmp_path / "tls"))


@pytest.fixture
def tls_etcd(tmp_path, tls) -> Iterator[Etcd]:
    """A one-member etcd serving its clients over TLS, checking their certificates."""
    if not etcd_available():
        pytest.skip("etcd is not installed (make apt: etcd-server, etcd-client)")
    e = Etcd(str(tmp_path), tls=tls)
    e.start()
    yield e
    e.stop()


def enable_auth(etcd: Etcd) -> None:
    """Auth on, and a user ``quiver`` that may read and write /quiver/ alone."""
    for args in (("user", "add", "root:root-password"), ("user", "add", f"quiver:{PASSWORD}"),
                 ("role", "add", "quiver"),
                 ("role", "grant-permission", "quiver", "--prefix=true", "readwrite",
                  "/quiver/"),
                 ("user", "grant-role", "quiver", "quiver"), ("auth", "enable")):
        etcd.ctl(*args)
    etcd.user = "root:root-password"


def never_leads(c: CoordinatorProcess, etcd: Etcd, why: str) -> None:
    """``c``, started, logs ``why`` once, stands by for three of its tries to lead and
    writes nothing; it stops cleanly."""
    c.start()
    try:
        wait_for(lambda: why in log_of(c), f"the log line {why!r}")
        end = time.monotonic() + 3 * TTL
        while time.monotonic() < end:
            assert role(c) == "standby"
            assert beat(c, "b") == {"not_leader": {"leader": None}}
        lines = [line for line in log_of(c).splitlines() if why in line]
        assert len(lines) == 1, log_of(c)
        assert "Traceback" not in log_of(c)
        assert etcd.keys() == {}
    finally:
        assert c.stop() == 0


def test_a_coordinator_leads_through_etcd_over_tls_with_its_client_certificate(
        tmp_path, tls, tls_etcd):
    c = coordinator(tmp_path, tls_etcd, "c1", ("--etcd-ca", tls.ca, "--etcd-cert",
                                               tls.client_cert, "--etcd-key", tls.client_key))
    c.start()
    try:
        wait_for(lambda: role(c) == "leader", "the coordinator to lead")
        beat(c, "a")
        wait_for(lambda: PREFIX + "nodes/a" in tls_etcd.keys(), "node a's key in etcd")
    finally:
        assert c.stop() == 0


@pytest.mark.parametrize("left_out, why", [
    ("--etcd-cert", "give --etcd-cert and --etcd-key)"),
    ("--etcd-ca", "give --etcd-ca, the CA that signed etcd's certificate)"),
])
def test_a_coordinator_without_what_tls_etcd_wants_never_leads_and_says_why(
        tmp_path, tls, tls_etcd, left_out, why):
    args = {"--etcd-ca": (tls.ca,), "--etcd-cert": (tls.client_cert, "--etcd-key",
                                                   tls.client_key)}
    args.pop(left_out)
    c = coordinator(tmp_path, tls_etcd, "c1",
                    tuple(a for option, rest in args.items() for a in (option, *rest)))
    never_leads(c, tls_etcd, why)


def test_a_coordinator_authenticates_as_its_etcd_user_and_again_after_etcd_restarts(
        tmp_path, etcd):
    enable_auth(etcd)
    password = tmp_path / "etcd-password"
    password.write_text(PASSWORD + "\n")
    c = coordinator(tmp_path, etcd, "c1", ("--etcd-user", "quiver", "--etcd-password-file",
                                           str(password)))
    c.start()
    try:
        wait_for(lambda: role(c) == "leader", "the coordinator to lead")
        beat(c, "a")
        wait_for(lambda: PREFIX + "nodes/a" in etcd.keys(), "node a's key in etcd")
        etcd.stop()  # its simple tokens live in its memory: the coordinator's is gone
        etcd.start()
        wait_for(lambda: role(c) == "leader", "the coordinator to lead on")
        beat(c, "b")
        wait_for(lambda: PREFIX + "nodes/b" in etcd.keys(), "node b's key in etcd")
        assert "Traceback" not in log_of(c)
    finally:
        assert c.stop() == 0


@pytest.mark.parametrize("user, why", [
    ("quiver", "refused user 'quiver': etcdserver: authentication failed, invalid user ID "
               "or password (check --etcd-user and --etcd-password-file)"),
    (None, "etcdserver: user name is empty (auth is on in etcd: give --etcd-user and "
           "--etcd-password-file)"),
])
def test_a_coordinator_etcd_does_not_let_in_never_leads_and_says_why(tmp_path, etcd, user,
                                                                    why):
    enable_auth(etcd)
    password = tmp_path / "etcd-password"
    password.write_text("not the password\n")
    args = () if user is None else ("--etcd-user", user, "--etcd-password-file",
                                     str(password))
    never_leads(coordinator(tmp_path, etcd, "c1", args), etcd, why)
