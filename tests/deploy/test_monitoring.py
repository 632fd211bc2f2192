"""ServiceMonitor, PrometheusRule and the Grafana dashboard: their structure, and that every query
asks only for series the exporter really exposes (built from its output on a sample snapshot)."""

from __future__ import annotations

import functools
import json
import re
from functools import cache
from typing import Any, cast

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

import deviceplugin
from deviceplugin.dra.kubeapi import KubeApi
from deviceplugin.dra.publisher import SlicePublisher
from deviceplugin.dra.settings import DraSettings
from deviceplugin.model import NodeSnapshot
from deviceplugin.reload import ReloadMetrics, config_hash
from deviceplugin.usage.metrics import DaemonMetrics
from tests.deploy.support import (
    BASE,
    DEPLOY,
    KUSTOMIZATION,
    MONITORING,
    NAMESPACE,
    one,
)
from tests.unit.test_metrics import dra_sample_snapshot, sample_snapshot

# docs/design.md §5 and the issue that made the dashboard: the series the dashboard and alerts
# rely on.
CONTRACT = {
    "vgpu_gpu_info",
    "vgpu_gpu_healthy",
    "vgpu_gpu_memory_total_bytes",
    "vgpu_gpu_memory_used_bytes",
    "vgpu_gpu_utilization_ratio",
    "vgpu_slices",
    "vgpu_container_gpu_memory_used_bytes",
    "vgpu_container_gpu_memory_limit_bytes",
    "vgpu_container_sm_utilization_ratio",
    "vgpu_container_compute_share_ratio",
    "vgpu_container_throttled_seconds_total",
    "vgpu_enforcement_actions_total",
    "vgpu_allocate_duration_seconds_bucket",
    "vgpu_poll_duration_seconds_bucket",
    "vgpu_kubelet_registrations_total",
    "vgpu_snapshot_stale",
    "vgpu_last_successful_poll_timestamp_seconds",
    "vgpu_kubelet_registered",
    "vgpu_gpu_unattributed_processes",
    "vgpu_build_info",
}
REQUIRED_ALERTS = {
    "VgpuGpuUnhealthy",
    "VgpuContainerRepeatedlyKilled",
    "VgpuContainerThrottledLong",
    "VgpuDaemonNotPolling",
    "VgpuNotRegistered",
    "VgpuSlicesExhausted",
    "VgpuDraDeviceFull",
    "VgpuDaemonAbsent",
    "VgpuMpsWedged",
}
# dcgm-exporter's series that the recording rules join, with the labels it gives them.
DCGM_SERIES = {
    "DCGM_FI_PROF_SM_ACTIVE": {"gpu", "UUID", "device", "modelName", "Hostname"},
    "DCGM_FI_DEV_FB_USED": {"gpu", "UUID", "device", "modelName", "Hostname"},
}
SEVERITIES = {"critical", "warning", "info"}
# Series Prometheus itself records about each scrape target.
SCRAPE_SERIES = {"up": set[str]()}
# Labels Prometheus adds to every scraped series (the ServiceMonitor's target labels).
TARGET_LABELS = {"instance", "job", "endpoint", "service", "namespace", "pod", "container"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}
# Grafana's variables, as Prometheus would receive them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "3h", "$__interval": "30s"}
LABEL_VALUES = re.compile(r"^label_values\((.*), *([A-Za-z_][A-Za-z0-9_]*)\)$")
LABEL_REF = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")
BY = re.compile(r"\bby\s*\(([^)]*)\)")


VERSION = deviceplugin.__version__


def _same(snapshot: NodeSnapshot) -> NodeSnapshot:
    return snapshot


@cache
def exposed() -> dict[str, set[str]]:
    """Sample name -> label names, from the exporter's text output for a sample snapshot."""
    series: dict[str, set[str]] = {}
    # A device-plugin node's and a DRA node's: each mode has series of its own.
    for snapshot in (sample_snapshot(), dra_sample_snapshot()):
        metrics = DaemonMetrics("node-a", functools.partial(_same, snapshot), version=VERSION)
        # The daemon adds the config reload series to the same registry, and in DRA mode the
        # ResourceSlice's publication series.
        ReloadMetrics(metrics.registry, "node-a", config_hash(b""))
        publisher = SlicePublisher(DraSettings(node_name="node-a"), cast(KubeApi, None), list)
        metrics.registry.register(publisher.collector("node-a"))
        metrics.observe_allocate(0.001)
        metrics.observe_poll(0.002)
        payload, _ = metrics.render()
        for family in text_string_to_metric_families(payload.decode()):
            for suffix in SUFFIXES.get(family.type, ("",)):
                series.setdefault(family.name + suffix, set())
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """Every series selector of a PromQL expression (a Grafana query: variables filled in, and
    label_values(SELECTOR, LABEL) read as its selector). ValueError if it does not parse."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    label_values = LABEL_VALUES.match(expr)
    if label_values:
        expr = label_values.group(1)
    found: list[promql_parser.VectorSelector] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def metric_names(expr: str) -> set[str]:
    return {s.name for s in selectors(expr) if s.name is not None}


def all_rules() -> list[dict[str, Any]]:
    rule = one(MONITORING / "prometheusrule.yaml")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def rules() -> list[dict[str, Any]]:
    """The alerting rules."""
    return [r for r in all_rules() if "alert" in r]


def recording_rules() -> list[dict[str, Any]]:
    return [r for r in all_rules() if "record" in r]


def dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return result


def dashboard_exprs() -> list[str]:
    exprs = [
        target["expr"]
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    exprs += [
        var["query"]["query"] for var in dashboard()["templating"]["list"] if var["type"] == "query"
    ]
    return exprs


def test_the_exporter_exposes_what_dashboards_and_alerts_rely_on() -> None:
    missing = CONTRACT - exposed().keys()
    assert not missing, f"the exporter does not expose {sorted(missing)}"


# --- PrometheusRule -----------------------------------------------------------------------------


def test_prometheus_rule_structure() -> None:
    rule = one(MONITORING / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["metadata"]["namespace"] == NAMESPACE
    alerts = [r["alert"] for r in rules()]
    assert len(alerts) == len(set(alerts))
    assert set(alerts) >= REQUIRED_ALERTS
    for r in rules():
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in SEVERITIES, r["alert"]
        assert re.fullmatch(r"\d+[smh]", r.get("for", "0m")), r["alert"]
        annotations = r["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, r["alert"]
        assert annotations["runbook_url"].endswith("/daemonset/README.md#" + r["alert"].lower()), r[
            "alert"
        ]


def test_every_alert_has_a_runbook_section() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for r in rules():
        assert f"\n### {r['alert']}\n" in readme, f"no runbook section for {r['alert']}"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: str(r["alert"]))
def test_alert_queries_use_only_exposed_series(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    unknown = names - exposed().keys() - SCRAPE_SERIES.keys()
    assert not unknown, f"{rule['alert']} asks for {sorted(unknown)}, which the exporter lacks"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: str(r["alert"]))
def test_alert_annotations_name_labels_the_alert_has(rule: dict[str, Any]) -> None:
    expr = rule["expr"]
    groupings = BY.findall(expr)
    if groupings:  # an aggregation keeps only its `by` labels
        available = set.intersection(
            *({label.strip() for label in g.split(",")} for g in groupings)
        )
    else:
        known = exposed() | SCRAPE_SERIES
        series = [known[name] for name in metric_names(expr)] or [set()]
        available = set.union(*series) | TARGET_LABELS | relabelled_target_labels()
    text = " ".join(rule["annotations"].values())
    missing = set(LABEL_REF.findall(text)) - available
    assert not missing, f"{rule['alert']} names labels its series lack: {sorted(missing)}"


def relabelled_target_labels() -> set[str]:
    """Labels the ServiceMonitor's relabelings give every target (`up` included)."""
    (endpoint,) = one(MONITORING / "servicemonitor.yaml")["spec"]["endpoints"]
    return {r["targetLabel"] for r in endpoint.get("relabelings", [])}


def test_the_absent_alert_fires_when_no_daemon_is_scraped_at_all() -> None:
    (absent,) = [r for r in rules() if r["alert"] == "VgpuDaemonAbsent"]
    assert absent["expr"] == 'absent(up{job="vgpu-device-plugin"})'
    # The ServiceMonitor names the job, whatever the Service is called (a Helm release may
    # rename it).
    (endpoint,) = one(MONITORING / "servicemonitor.yaml")["spec"]["endpoints"]
    assert {"targetLabel": "job", "replacement": "vgpu-device-plugin"} in endpoint["relabelings"]


# --- recording rules: vgpu joined with dcgm-exporter ---------------------------------------------


def test_recording_rules_are_named_by_convention_and_join_on_gpu_uuid() -> None:
    recorded = recording_rules()
    assert {r["record"] for r in recorded} >= {"vgpu:dcgm_sm_active:ratio"}
    for r in recorded:
        assert set(r) == {"record", "expr"}, r["record"]
        # level:metric:operations, the Prometheus naming convention for recorded series
        assert re.fullmatch(r"vgpu:[a-z_]+:[a-z_]+", r["record"]), r["record"]
        expr = r["expr"]
        names = metric_names(expr)
        dcgm = names & DCGM_SERIES.keys()
        assert dcgm, f"{r['record']} reads no dcgm-exporter series"
        assert names - DCGM_SERIES.keys() <= exposed().keys(), r["record"]
        # dcgm-exporter's UUID becomes vgpu's gpu_uuid, and the join is on it alone.
        assert "label_replace(" in expr, r["record"]
        assert '"gpu_uuid", "$1", "UUID"' in expr, r["record"]
        assert "on (gpu_uuid) group_left (node, gpu_index, model)" in expr, r["record"]
        assert {"node", "gpu_uuid", "gpu_index", "model"} <= exposed()["vgpu_gpu_info"]


# --- ServiceMonitor -----------------------------------------------------------------------------


def test_service_monitor_scrapes_the_service() -> None:
    monitor = one(MONITORING / "servicemonitor.yaml")
    service = one(BASE / "service.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # Container series carry the workload's namespace/pod/container: keep them as exposed.
    assert endpoint["honorLabels"] is True
    # `up` of each target names the node of its pod, as every alert promises.
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
    } in endpoint["relabelings"]


def test_the_monitoring_component_ships_the_dashboard_for_grafana() -> None:
    component = one(MONITORING / KUSTOMIZATION)
    assert component["kind"] == "Component"
    (generator,) = component["configMapGenerator"]
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
    assert generator["options"]["disableNameSuffixHash"] is True
    assert generator["files"] == ["vgpu-device-plugin.json=grafana-dashboard.json"]
    overlay = one(DEPLOY / "overlays" / "prometheus-operator" / KUSTOMIZATION)
    assert overlay["components"] == ["../../monitoring"]
    # The plain install stays free of Prometheus Operator resources.
    assert one(DEPLOY / KUSTOMIZATION)["resources"] == ["base"]
    assert "components" not in one(BASE / KUSTOMIZATION)


# --- the dashboard ------------------------------------------------------------------------------


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] == "vgpu-device-plugin"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["node"]["type"] == "query"
    assert variables["node"]["query"]["query"].endswith(", node)")
    assert variables["node"]["multi"] is True
    assert variables["node"]["includeAll"] is True
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in d["panels"] if p["type"] == "row")
    for row in ("GPUs", "Containers", "Enforcement", "Daemon"):
        assert row in titles
    for panel in d["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
            assert panel.get("description"), panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"], panel["title"]


def test_dashboard_queries_use_only_exposed_series() -> None:
    for expr in dashboard_exprs():
        unknown = metric_names(expr) - exposed().keys()
        assert not unknown, f"{expr!r} asks for {sorted(unknown)}, which the exporter lacks"


def test_dashboard_queries_follow_the_node_variable() -> None:
    for expr in dashboard_exprs():
        if expr == "label_values(vgpu_build_info, node)":
            continue  # the variable's own query
        for selector in selectors(expr):
            node = [(str(m.op), m.value) for m in selector.matchers.matchers if m.name == "node"]
            assert node == [("MatchOp.Re", "$node")], f"{selector.name} in {expr!r} ignores $node"


def test_every_query_parses_and_selects_by_name() -> None:
    """Syntax, and no selector without a metric name (which would match every series)."""
    for expr in dashboard_exprs() + [r["expr"] for r in all_rules()]:
        for selector in selectors(expr):
            assert selector.name, f"a selector without a metric name in {expr!r}"


def test_dashboard_shows_every_contract_series() -> None:
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert CONTRACT - used == set()


def panel_exprs(title_part: str) -> list[str]:
    panels = [p for p in dashboard()["panels"] if title_part in p["title"]]
    assert panels, f"no panel titled {title_part!r}"
    return [t["expr"] for p in panels for t in p["targets"]]


def test_gpus_healthy_counts_physical_gpus_and_mig_devices_apart() -> None:
    """A GPU in MIG mode and each of its MIG devices are all vgpu_gpu_healthy series: counting
    them all, 3 GPUs with one split in 3 read 6."""
    exprs = panel_exprs("GPUs healthy")
    gpu_exprs = [e for e in exprs if 'parent_gpu_uuid=""' in e]
    mig_exprs = [e for e in exprs if 'parent_gpu_uuid!=""' in e]
    assert len(gpu_exprs) == 2
    assert len(mig_exprs) == 2
    assert len(exprs) == 4


def test_the_dashboard_shows_xids_attribution_config_reloads_and_mps() -> None:
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert {
        "vgpu_gpu_xid_errors_total",
        "vgpu_gpu_misattributed_processes",
        "vgpu_config_reloads_total",
        "vgpu_config_info",
        "vgpu_mps_daemon_up",
        "vgpu_mps_daemon_restarts_total",
    } <= used


def test_no_panel_calls_nvml_gpu_utilisation_sm_utilisation() -> None:
    for panel in dashboard()["panels"]:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        if any("vgpu_gpu_utilization_ratio" in e for e in exprs):
            assert "SM" not in panel["title"], panel["title"]
