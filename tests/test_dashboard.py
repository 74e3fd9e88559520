"""The Grafana dashboard, docs/grafana/quiver.json: it loads, every panel queries the
Prometheus datasource it asks for at import, counters are read through rate() or
increase(), and every metric its PromQL names is exported by a real mountd or a real
``quiver coordinator``, scraped over loopback."""
from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiverfs.bench.data import Tree
from quiverfs.bench.processes import CoordinatorProcess, free_port
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401
from tests.test_metrics import read_tree, scrape, start_job, value

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "quiver.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SCRAPE_DEADLINE = 30.0  # seconds for the job's chunk cycle to reach the coordinator
# What the issue asks the dashboard to show: reads per tier, bucket bytes per cause, store
# use, chunk states, allocation, loader pools.
REQUIRED = {"quiver_hits_total", "quiver_misses_total", "quiver_bucket_fetch_bytes_total",
            "quiver_cache_used_bytes", "quiver_cache_limit_bytes", "quiver_coordinator_chunks",
            "quiver_coordinator_dataset_mode", "quiver_loader_processes",
            "quiver_read_seconds_bucket"}

# PromQL's words that are not metric names (functions are told by their parenthesis).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "bool", "offset"}
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{[^{}]*\}")
RANGES = re.compile(r"\[[^\]]*\]")
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")  # Grafana's
NAMES = re.compile(r"(?<![\w.:])[a-zA-Z_:][\w:]*(?![\w:]|\s*\()")
# Series that only go up, which a panel must read as a rate or an increase.
COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
LABEL_VALUES = re.compile(r"\s*label_values\((?:(.*),)?\s*\w+\s*\)\s*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: not its functions, keywords, label
    names and values, durations or Grafana variables."""
    bare = STRINGS.sub(" ", expr)
    for pattern in (RANGES, MATCHERS, LABEL_LISTS, VARIABLES):
        bare = pattern.sub(" ", bare)
    return {name for name in NAMES.findall(bare) if name not in KEYWORDS}


def variable_metrics(query: str) -> set[str]:
    """The metric names of a template variable's query (``label_values(EXPR, label)``)."""
    values = LABEL_VALUES.fullmatch(query)
    if values is not None:
        return metric_names(values.group(1) or "")
    return metric_names(query)


def load() -> dict[str, Any]:
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but the rows, those in collapsed rows too."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Every metric name in the panels' queries and the template variables'."""
    names = set().union(*(metric_names(expr) for expr in expressions(dashboard)))
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]
        names |= variable_metrics(query["query"] if isinstance(query, dict) else query)
    return names


def exported(text: str) -> dict[str, str]:
    """Family name -> type of a /metrics page (a counter's family is its name less
    ``_total``; a histogram's, less ``_bucket``, ``_sum``, ``_count``)."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def is_exported(name: str, families: dict[str, str]) -> bool:
    """Whether a series named ``name`` belongs to one of ``families``."""
    if families.get(name) in ("gauge", "untyped", "unknown"):
        return True
    return any(name.endswith(suffix) and families.get(name[:-len(suffix)]) == kind
               for kind, suffixes in SUFFIXES.items() for suffix in suffixes)


def metrics_page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_names_are_found_in_promql():
    assert metric_names('histogram_quantile(0.99, sum by (tier, le) (rate('
                        'quiver_read_seconds_bucket{instance=~"$node", tier="local"}'
                        '[$__rate_interval])))') == {"quiver_read_seconds_bucket"}
    assert metric_names('sum(a_total{x="rate(b) c"}) / ignoring(le) c offset 5m + 2 * d:e'
                        ) == {"a_total", "c", "d:e"}
    assert metric_names("sum without (job) (rate(x_total[5m])) > bool 1e3") == {"x_total"}
    assert variable_metrics('label_values(up{instance=~"$node"}, dataset)') == {"up"}
    assert variable_metrics("label_values(instance)") == set()


def test_the_dashboard_loads_and_every_panel_queries_the_prometheus_input():
    dashboard = load()
    (ds_input,) = dashboard["__inputs"]
    assert (ds_input["name"], ds_input["type"], ds_input["pluginId"]) == (
        "DS_PROMETHEUS", "datasource", "prometheus")
    found = list(panels(dashboard))
    assert len(found) >= 20
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    ids = [p["id"] for p in rows + found]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in found:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip() and metric_names(target["expr"]), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == DATASOURCE, variable["name"]
    assert REQUIRED <= dashboard_metrics(dashboard)


def test_counters_are_read_as_rates():
    """A counter's raw value (its count since the daemon started) means nothing on a
    graph: every counter and histogram series sits in rate(), irate() or increase()."""
    for expr in expressions(load()):
        bare = VARIABLES.sub("", MATCHERS.sub("", STRINGS.sub('""', expr)))
        for name in metric_names(expr):
            if not name.endswith(COUNTER_SUFFIXES):
                continue
            for use in re.finditer(rf"(?<![\w:]){name}(?![\w:])", bare):
                before, after = bare[:use.start()], bare[use.end():]
                assert (re.search(r"\b(?:rate|irate|increase)\(\s*$", before)
                        and re.match(r"\s*\[", after)), f"{name} is not a rate in {expr}"


@pytest.fixture
def coordinator(tmp_path) -> Iterator[tuple[CoordinatorProcess, int]]:
    """A ``quiver coordinator`` with its metrics on; (it, its metrics port). Requested
    before mountd_factory, it stops after the node."""
    (tmp_path / "secret").write_bytes(b"a-cluster-secret-for-the-dashboard-test")
    port = free_port()
    co = CoordinatorProcess(str(tmp_path / "coordinator"), str(tmp_path / "secret"),
                            str(tmp_path / "coordinator.log"),
                            extra_args=("--metrics", f"127.0.0.1:{port}"))
    co.start()
    yield co, port
    assert co.stop() == 0


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
def test_every_metric_the_dashboard_names_is_exported(coordinator, mountd_factory,
                                                      synthetic_tree: Tree, tmp_path):
    co, co_port = coordinator
    node_port = free_port()
    m = mountd_factory(extra_args=(
        "--coordinator", co.address, "--listen", "127.0.0.1:0", "--node-id", "node",
        "--cluster-secret-file", co.secret_file, "--metrics", f"127.0.0.1:{node_port}"))
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn")
    assert read_tree(Path(m.root) / "syn") == 40
    job = start_job(Path(m.root), "syn")  # a job: the dataset gets a chunk cycle
    deadline = time.monotonic() + SCRAPE_DEADLINE
    while not any(name == "quiver_coordinator_chunks" and ("dataset", "syn") in labels
                  for name, labels in scrape(co_port)):
        assert time.monotonic() < deadline, "the job's chunk cycle never reached the coordinator"
        time.sleep(0.1)
    assert value(scrape(node_port), "quiver_hits_total", tier="bucket") == 40

    families = exported(metrics_page(node_port)) | exported(metrics_page(co_port))
    missing = sorted(n for n in dashboard_metrics(load()) if not is_exported(n, families))
    assert not missing, f"the dashboard names metrics nothing exports: {missing}"
    os.rmdir(job)
