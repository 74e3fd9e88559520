"""Private buckets: ``quiver mount --credentials KEY`` against a real mountd, the GCS
emulator behind a proxy that records each request's headers, and an OAuth token
endpoint on loopback that signs nothing but checks each key's JWT."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from quiverfs.bench.request_log import RequestLog
from quiverfs.bench.throttle_proxy import UNCAPPED, throttled
from tests.mountd_helpers import (call_as, dataset_counters, make_digest, mountd_factory,
                                  tree_hashes)
from tests.token_endpoint import JWT_BEARER, new_key, token_endpoint

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

EMAIL = "reader@quiver-test.iam.gserviceaccount.com"
REVOKED = "revoked@quiver-test.iam.gserviceaccount.com"


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_key(path: str, info: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(info, f)
    return path


def write_digest(path: str, uri: str, emulator_host: str) -> str:
    """The digest of ``uri`` (named syn), written to ``path``."""
    with open(path, "wb") as f:
        f.write(make_digest(uri, "syn", emulator_host))
    return path


def mount_cli(quiver, m, digest_file: str, key_file: str, name: str):
    return quiver("mount", digest_file, "--name", name, "--credentials", key_file,
                  "--root", m.root, "--control-socket", m.socket)


def test_a_private_bucket_is_read_with_the_keys_token_also_after_a_restart(
        mountd_factory, quiver, synthetic_tree, upload, gcs_emulator, tmp_path, monkeypatch):
    digest_file = write_digest(str(tmp_path / "syn.qd"),
                               upload(synthetic_tree.root, "syn"), gcs_emulator.host)
    key = new_key(EMAIL)
    requests = RequestLog()
    with token_endpoint([key]) as tokens, \
            throttled(gcs_emulator.host, UNCAPPED, request_log=requests) as proxy:
        key_file = write_key(str(tmp_path / "key.json"), key.info(tokens.url))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        m = mountd_factory()
        r = mount_cli(quiver, m, digest_file, key_file, "syn")
        assert r.returncode == 0, r.stderr
        grants = tokens.recorded()
        assert grants and all(g == grants[0] for g in grants)
        assert grants[0].grant_type == JWT_BEARER and grants[0].issuer == EMAIL

        expected = tree_hashes(synthetic_tree.root)
        paths = sorted(expected)
        first, second = paths[:20], paths[20:]
        for p in first:
            assert sha256_of(os.path.join(m.root, "syn", p)) == expected[p]
        before = requests.requests()
        downloads = [q for q in before if "alt=media" in q.target]
        assert len(downloads) == len(first) == dataset_counters(m, "syn")["bucket_fetches"]
        assert {q.headers.get("authorization") for q in before} == {"Bearer token-1"}

        # A restart restores the registration with its saved key: new tokens, new fetches.
        assert m.stop() == 0
        tokens.token = "token-2"
        granted = len(tokens.recorded())
        m2 = mountd_factory(cache_dir=m.cache_dir)
        assert [d["name"] for d in m2.status()["datasets"]] == ["syn"]
        for p in second:
            assert sha256_of(os.path.join(m2.root, "syn", p)) == expected[p]
        after = requests.requests()[len(before):]
        assert len([q for q in after if "alt=media" in q.target]) == len(second)
        assert {q.headers.get("authorization") for q in after} == {"Bearer token-2"}
        assert all(g.issuer == EMAIL for g in tokens.recorded()[granted:])
        assert dataset_counters(m2, "syn")["bucket_fetches"] == len(second)


def test_a_key_its_token_endpoint_refuses_is_refused_and_nothing_is_saved(
        mountd_factory, quiver, synthetic_tree, upload, gcs_emulator, tmp_path, monkeypatch):
    digest_file = write_digest(str(tmp_path / "syn.qd"),
                               upload(synthetic_tree.root, "syn"), gcs_emulator.host)
    key = new_key(REVOKED)
    requests = RequestLog()
    with token_endpoint([key], refused={REVOKED}) as tokens, \
            throttled(gcs_emulator.host, UNCAPPED, request_log=requests) as proxy:
        key_file = write_key(str(tmp_path / "revoked.json"), key.info(tokens.url))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        m = mountd_factory()
        r = mount_cli(quiver, m, digest_file, key_file, "syn")
        assert r.returncode == 6, r.stderr
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and REVOKED in lines[0] and "invalid_grant" in lines[0], lines
        assert [g.issuer for g in tokens.recorded()] == [REVOKED]
        assert requests.requests() == []
        state = os.path.join(m.cache_dir, "state")
        assert os.listdir(os.path.join(state, "credentials")) == []
        assert os.listdir(os.path.join(state, "digests")) == []
        records = os.path.join(state, "registrations.json")
        if os.path.exists(records):
            with open(records, encoding="utf-8") as f:
                assert json.load(f) == []
        assert m.status()["datasets"] == []
        assert "syn" not in os.listdir(m.root)


def test_a_users_key_whose_token_endpoint_is_not_googles_is_refused_unposted(
        shared_workdir, mountd_factory, synthetic_tree, upload, gcs_emulator):
    data = make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)
    key = new_key(EMAIL)
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"))
    os.chmod(m.cache_dir, 0o755)
    with token_endpoint([key]) as tokens:
        reply = call_as(1000, 1000, m.socket, {"op": "mount", "name": "syn", "digest": data,
                                               "credentials": key.info(tokens.url)})
        assert not reply["ok"] and reply["code"] == 6, reply
        assert f"token_uri '{tokens.url}' is not Google's" in reply["error"]
        # Google's token endpoint, but a universe whose keys sign their own tokens
        elsewhere = {**key.info("https://oauth2.googleapis.com/token"),
                     "universe_domain": "example.com"}
        reply = call_as(1000, 1000, m.socket, {"op": "mount", "name": "syn", "digest": data,
                                               "credentials": elsewhere})
        assert not reply["ok"] and reply["code"] == 6, reply
        assert "universe_domain 'example.com' is not 'googleapis.com'" in reply["error"]
        assert tokens.recorded() == []
    assert os.listdir(os.path.join(m.cache_dir, "state", "credentials")) == []
    assert m.status()["datasets"] == []


def test_a_registration_dropped_at_restart_leaves_no_key_behind(
        mountd_factory, quiver, synthetic_tree, upload, gcs_emulator, tmp_path, monkeypatch):
    digest_file = write_digest(str(tmp_path / "syn.qd"),
                               upload(synthetic_tree.root, "syn"), gcs_emulator.host)
    key = new_key(EMAIL)
    with token_endpoint([key]) as tokens:
        key_file = write_key(str(tmp_path / "key.json"), key.info(tokens.url))
        m = mountd_factory()
        r = mount_cli(quiver, m, digest_file, key_file, "syn")
        assert r.returncode == 0, r.stderr
    state = os.path.join(m.cache_dir, "state")
    assert os.listdir(os.path.join(state, "credentials")) == ["syn.json"]
    assert m.stop() == 0
    for name in os.listdir(os.path.join(state, "digests")):  # the registration cannot load
        os.unlink(os.path.join(state, "digests", name))
    m2 = mountd_factory(cache_dir=m.cache_dir)
    assert m2.status()["datasets"] == []
    assert "dropping dataset 'syn'" in m2.log_tail(50)
    assert os.listdir(os.path.join(state, "credentials")) == []
