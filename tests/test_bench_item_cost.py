"""``quiver bench item-cost`` keeps working: a quick run end to end, a real mountd."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.item_cost import WAYS, run

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_reports_each_ways_costs_per_item(tmp_path):
    report = run(quick=True, workdir=str(tmp_path))
    summary = report["summary"]
    for way in WAYS:
        got = report["ways"][way]
        assert got["items"] == 2 * summary["items"]  # two epochs after the warm-up
        assert summary[f"wall_ms_per_item_{way}"] > 0
        assert summary[f"mountd_cpu_ms_per_item_{way}"] >= 0
    assert set(summary) >= {"sampler_vs_exact", "view_vs_exact"}
    # every view file is opened once, by the native plane but for a few (the first of
    # a folder in a pass) through mountd
    view = report["ways"]["view"]["requests_per_item"]
    assert abs(view["control.open"] + view["native.view_opens"] - 1.0) <= 0.002
    assert view["control.open"] <= 0.05
    # exact reads reach mountd: about one READ per item. Not exactly one: the files are
    # kept in the page cache between opens (keep_cache), and fadvise(DONTNEED) may
    # leave a page it cannot drop at that moment (CI once saw 0.991)
    assert report["ways"]["exact"]["requests_per_item"]["read"] >= 0.95
