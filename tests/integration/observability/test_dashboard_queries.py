"""Every dashboard panel and every rule returns data from a live cluster, evaluated by a real
Prometheus (its HTTP API), and `promtool check rules` passes on the rules file.

An alert's condition is checked through its operands (`a > 0.9`: `a` must have data; a
misspelt metric gives none, and the alert would silently never fire): a query answers "data"
when it has a sample with a finite value.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from prometheus_server import DASHBOARD, REPO, RULES, Observed, host_port, require_prometheus
from promql import alert_operands, dashboard_queries, rules


def test_every_dashboard_panel_has_data(observed: Observed) -> None:
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= 40
    empty = [(title, expr) for title, expr in queries if not observed.prometheus.finite(expr)]
    assert not empty, f"panels without data: {empty}"


def test_every_recording_rule_and_alert_operand_has_data(observed: Observed) -> None:
    recording, alerting = rules(RULES)
    checked = [(name, expr) for name, expr in recording]
    for name, expr in alerting:
        operands = alert_operands(expr)
        assert operands, name
        checked += [(f"{name}: {operand}", operand) for operand in operands]
    empty = [(name, expr) for name, expr in checked if not observed.prometheus.finite(expr)]
    assert not empty, f"rules without data: {empty}"
    assert {name for name, _ in recording} >= {"pdserve:ttft_seconds:p90_5m"}
    loaded = observed.prometheus.api("rules")["groups"]
    bad = [(r["name"], r.get("lastError")) for g in loaded for r in g["rules"]
           if r["health"] != "ok"]  # fmt: skip
    assert not bad, bad
    assert sum(len(g["rules"]) for g in loaded) == len(recording) + len(alerting)


def test_no_alert_fires_on_a_healthy_cluster(observed: Observed) -> None:
    alerts = observed.prometheus.api("alerts")["alerts"]
    # (the latency alerts may be pending on a busy 2-core machine; they fire after 5 minutes)
    assert [a["labels"]["alertname"] for a in alerts if a["state"] == "firing"] == []


def test_a_misspelt_metric_has_no_data(observed: Observed) -> None:
    prometheus = observed.prometheus
    assert prometheus.finite('sum(rate(pdserve_requests_total{outcome="ok"}[30s]))')
    assert not prometheus.finite('sum(rate(pdserve_request_total{outcome="ok"}[30s]))')
    assert not prometheus.finite("pdserve:ttft_secnds:p90_5m > 0")
    (operand,) = alert_operands("pdserve_worker_kv_blocks_usd / pdserve_worker_kv_blocks_total")
    assert not prometheus.finite(operand)


def test_every_target_is_scraped(observed: Observed) -> None:
    targets = observed.prometheus.api("targets")["activeTargets"]
    assert {t["labels"]["job"] for t in targets} == {"pdserve-router", "pdserve-controller"}
    assert all(t["health"] == "up" for t in targets), targets


def test_alert_operands_are_the_sides_of_its_comparisons() -> None:
    assert alert_operands('a:b > max(c{m="x>y"})') == ["a:b", 'max(c{m="x>y"})']
    assert alert_operands("x > on (w) group_left (s) y and z == 0") == ["x", "y", "z"]
    assert alert_operands("(rate(a[5m]) or b) > bool 2e3") == ["rate(a[5m])", "b"]
    assert alert_operands('sum by (role) (worker_or_orders{s="and"}) < 1') == [
        'sum by (role) (worker_or_orders{s="and"})'
    ]


def test_promtool_accepts_the_rules() -> None:
    require_prometheus()
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing beside prometheus (Debian's package ships both)")
    done = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_observe_script_points_prometheus_at_the_routers_and_the_controller(
    observed: Observed, tmp_path: Path
) -> None:
    from deploy.cli.daemon import ClusterState

    state_file = tmp_path / "cluster.json"
    state = ClusterState(
        pid=os.getpid(),
        targets=[observed.target],
        metrics=list(observed.router_metrics_urls),
        redis_url="",
        model_dir="",
        log="",
        ray_address=observed.ray_address,
        cluster_name="observed-tests",
    )
    state_file.write_text(json.dumps(asdict(state)))
    env = {**os.environ, "PDSERVE_STATE_FILE": str(state_file), "OBSERVE_DIR": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "observe.sh"), "--config-only"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets == {
        "pdserve-router": [host_port(u) for u in observed.router_metrics_urls],
        "pdserve-controller": [host_port(observed.controller_metrics_url)],
    }
    assert config["rule_files"] == [str(RULES)]
    promtool = shutil.which("promtool")
    assert promtool is not None
    checked = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (tmp_path / "grafana" / "provisioning" / "dashboards" / "pdserve.yml").exists()


def test_grafana_provisioning_loads_the_dashboard_from_a_prometheus_datasource() -> None:
    grafana = DASHBOARD.parent
    (source,) = yaml.safe_load(
        (grafana / "provisioning" / "datasources" / "pdserve.yml").read_text()
    )["datasources"]
    assert (source["type"], source["url"]) == ("prometheus", "${PDSERVE_PROMETHEUS_URL}")
    (provider,) = yaml.safe_load(
        (grafana / "provisioning" / "dashboards" / "pdserve.yml").read_text()
    )["providers"]
    assert (provider["type"], provider["options"]["path"]) == ("file", "${PDSERVE_DASHBOARDS_DIR}")
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pdserve-overview"
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource", "datasource", "prometheus",
    )  # fmt: skip
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
