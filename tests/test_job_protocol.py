"""The manifest has one type on both sides (quiverfs.job_protocol), and a malformed one
is a clear error in the sampler, never a wrong batch."""
from __future__ import annotations

import pytest

from quiverfs.job_protocol import Manifest, ManifestError, decode_manifest, encode_manifest
from quiverfs.torch import QuiverBatchSampler

GOOD = Manifest(epoch=2, batch=5, hits=1, paths=["a/1.png", "b/2.png"], labels=["a", "b"],
                hashes=["00" * 32, "11" * 32])


def test_a_manifest_survives_its_round_trip_and_a_lone_batch_has_no_segment_key():
    assert decode_manifest(encode_manifest(GOOD)) == GOOD
    assert b"segment" not in encode_manifest(GOOD)
    segmented = Manifest(**{**{f: getattr(GOOD, f) for f in GOOD.__struct_fields__},
                            "segment": [["c/3.png"]]})
    assert decode_manifest(encode_manifest(segmented)).segment == [["c/3.png"]]


@pytest.mark.parametrize("data, problem", [
    (b"", "malformed manifest"),
    (b'{"epoch": 2, "batch": 5', "malformed manifest"),
    (b'{"epoch": 2, "batch": 5, "hits": 0, "paths": [], "labels": []}', "hashes"),
    (b'{"epoch": "2", "batch": 5, "hits": 0, "paths": [], "labels": [], "hashes": []}',
     "Expected `int`"),
    (b'{"epoch": 2, "batch": 5, "hits": 0, "paths": [], "labels": [], "hashes": [],'
     b' "extra": 1}', "extra"),
    (b'{"epoch": 2, "batch": 5, "hits": 0, "paths": ["a"], "labels": [], "hashes": []}',
     "1 paths, 0 labels, 0 hashes"),
    (b'{"epoch": 2, "batch": 5, "hits": 3, "paths": ["a"], "labels": ["a"], "hashes": ["0"]}',
     "3 hits"),
])
def test_a_malformed_manifest_names_its_problem(data, problem):
    with pytest.raises(ManifestError, match="malformed manifest") as info:
        decode_manifest(data)
    assert problem in str(info.value)


def _sampler_reading(tmp_path, name: str, data: bytes) -> QuiverBatchSampler:
    """A sampler whose job directory holds ``data`` as the batch file ``name``."""
    (tmp_path / name).write_bytes(data)
    sampler = object.__new__(QuiverBatchSampler)
    sampler.job_dir, sampler.epoch = str(tmp_path), 2
    return sampler


def test_the_sampler_reports_a_malformed_manifest_in_one_line(tmp_path):
    sampler = _sampler_reading(tmp_path, "e2-b5", b'{"epoch": 2, "batch": 5, "hits": 0}')
    with pytest.raises(RuntimeError) as info:
        sampler.manifest(5)
    message = str(info.value)
    assert message.startswith("quiver: mountd returned a malformed manifest")
    assert "batch 5 of epoch 2" in message and "version" in message and "\n" not in message


def test_the_sampler_reads_a_good_manifest(tmp_path):
    assert _sampler_reading(tmp_path, "e2-b5", encode_manifest(GOOD)).manifest(5) == GOOD


def test_the_sampler_refuses_the_manifest_of_another_batch(tmp_path):
    sampler = _sampler_reading(tmp_path, "e2-b6", encode_manifest(GOOD))
    with pytest.raises(RuntimeError, match="batch 5 of epoch 2 when asked for batch 6"):
        sampler.manifest(6)
