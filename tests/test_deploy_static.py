"""deploy/ checked without Docker: promtool/amtool on the shipped configs, rule unit tests, and
shape checks of the compose file, collector config, Grafana provisioning and dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from tensorwatch_otel.sinks import catalogue

# mostly waiting (a server's interval, a timeout): scripts/test.sh runs the tests marked `waits`
# beside the CPU-bound parallel pass, in a process of their own
pytestmark = pytest.mark.waits

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROM_DIR = DEPLOY / "prometheus"
RULE_FILES = sorted((PROM_DIR / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))

# The public series, from the metric catalogue both sinks build from; anything else named
# tensorwatch_* in deploy/ is a typo.
CONTRACT_SERIES = set(catalogue.prometheus_names())
ALERT_LABELS = {"module", "module_class", "tensor", "rank", "severity"}
COMPOSE_SERVICES = {"otel-collector", "prometheus", "alertmanager", "jaeger", "grafana"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install prometheus prometheus-alertmanager)")
    return path


def _run(argv: List[str], cwd: Path = DEPLOY) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


def _load_yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


# -- Prometheus and Alertmanager, checked by their own tools ------------------------------------

def test_promtool_check_config():
    res = _run([_tool("promtool"), "check", "config", "prometheus/prometheus.yml"])
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    # The config's rule_files glob must actually pick up the shipped rules.
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in out, out
    assert "WARNING" not in out, out


def test_promtool_check_rules():
    assert RULE_FILES, "no rule files in deploy/prometheus/rules"
    res = _run([_tool("promtool"), "check", "rules", *map(str, RULE_FILES)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_test_rules():
    assert RULE_TESTS, "no promtool unit tests in deploy/prometheus/tests"
    res = _run([_tool("promtool"), "test", "rules", *map(str, RULE_TESTS)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_rule_tests_catch_the_born_at_one_counter(tmp_path):
    """The unit tests must fail for the naive rule `increase(...) > 0`, which never fires for a
    counter whose first sample is already 1; otherwise they prove nothing about that case."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    doc = _load_yaml(PROM_DIR / "rules" / "tensorwatch.yml")
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "TensorwatchNonFinite":
                rule["expr"] = "increase(tensorwatch_nonfinite_events_total[15m]) > 0"
    (tmp_path / "rules" / "tensorwatch.yml").write_text(yaml.safe_dump(doc))
    for t in RULE_TESTS:
        shutil.copy(t, tmp_path / "tests" / t.name)
    res = _run([_tool("promtool"), "test", "rules", *(str(tmp_path / "tests" / t.name) for t in RULE_TESTS)],
               cwd=tmp_path)
    out = res.stdout + res.stderr  # promtool prints the failures on stderr
    assert res.returncode != 0, out
    assert "nonfinite counter born at 1 fires at once" in out, out


def test_amtool_check_config():
    res = _run([_tool("amtool"), "check-config", "alertmanager/alertmanager.yml"])
    assert res.returncode == 0, res.stdout + res.stderr


def _alert_rules() -> Dict[str, Dict[str, Any]]:
    rules = {}
    for path in RULE_FILES:
        for group in _load_yaml(path)["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    rules[rule["alert"]] = rule
    return rules


def test_contract_alerts_are_defined_with_labels_and_annotations():
    rules = _alert_rules()
    assert {"TensorwatchNonFinite", "TensorwatchRangeHigh"} <= set(rules)
    nonfinite, range_high = rules["TensorwatchNonFinite"], rules["TensorwatchRangeHigh"]
    assert nonfinite["labels"]["severity"] == "page"
    assert "for" not in nonfinite or nonfinite["for"] in ("0s", "0m", 0)  # the first inf pages
    assert range_high["labels"]["severity"] == "warning"
    assert re.search(r'dtype=~"[^"]*float16[^"]*"', range_high["expr"])
    assert "bfloat16" in range_high["expr"]
    for name in ("TensorwatchNonFinite", "TensorwatchRangeHigh"):
        ann = rules[name]["annotations"]
        assert ann.get("summary") and ann.get("description"), name
        # Every contract label shows up in the text a human reads (the promtool tests check that
        # the labels themselves survive the expression).
        text = ann["summary"] + ann["description"]
        for label in ALERT_LABELS - {"severity"}:
            assert f"$labels.{label}" in text, (name, label)
    assert "tensorwatch.nonfinite_detected" in rules["TensorwatchNonFinite"]["annotations"]["jaeger_search"]
    assert "$labels.first_rank" in rules["TensorwatchNonFinite"]["annotations"]["description"]
    under = rules["TensorwatchUnderflowHigh"]
    assert under["labels"]["severity"] == "warning" and "tensorwatch_tensor_underflow_ratio" in under["expr"]
    text = under["annotations"]["summary"] + under["annotations"]["description"]
    for label in ALERT_LABELS - {"severity"} | {"target_dtype"}:
        assert f"$labels.{label}" in text, ("TensorwatchUnderflowHigh", label)
    streak = rules["TensorwatchSkippedStepsStreak"]
    assert streak["labels"]["severity"] == "warning"
    assert "tensorwatch_optimizer_skip_streaks_total" in streak["expr"]
    assert "$labels.rank" in streak["annotations"]["summary"]
    skipped = rules["TensorwatchSkippedNonFiniteSteps"]  # on_detect="skip" skipped steps in the last 15 min
    assert skipped["labels"]["severity"] == "warning" and "for" not in skipped
    assert "tensorwatch_skipped_nonfinite_steps_total" in skipped["expr"] and "[15m]" in skipped["expr"]
    assert "$labels.rank" in skipped["annotations"]["summary"]
    assert skipped["annotations"]["runbook"].startswith("deploy/README.md#tensorwatchskippednonfinitesteps ")


def test_rule_tests_cover_the_contract_labels():
    """The promtool tests pin the full label set of both alerts."""
    seen: Dict[str, set] = {}
    for path in RULE_TESTS:
        for case in _load_yaml(path)["tests"]:
            for a in case.get("alert_rule_test", []):
                for exp in a.get("exp_alerts", []):
                    seen.setdefault(a["alertname"], set()).update(exp["exp_labels"])
    for name in ("TensorwatchNonFinite", "TensorwatchRangeHigh"):
        assert ALERT_LABELS <= seen.get(name, set()), (name, seen.get(name))
    assert "first_rank" in seen["TensorwatchNonFinite"]
    assert ALERT_LABELS | {"target_dtype"} <= seen.get("TensorwatchUnderflowHigh", set())
    assert {"rank", "severity"} <= seen.get("TensorwatchSkippedStepsStreak", set())
    assert {"rank", "severity"} <= seen.get("TensorwatchSkippedNonFiniteSteps", set())


def test_alertmanager_groups_by_job_and_rank_and_pages_fast():
    cfg = _load_yaml(DEPLOY / "alertmanager" / "alertmanager.yml")
    route = cfg["route"]
    assert {"job", "rank"} <= set(route["group_by"])
    receivers = {r["name"]: r for r in cfg["receivers"]}
    assert route["receiver"] in receivers
    assert receivers[route["receiver"]]["webhook_configs"][0]["url"].startswith("http")
    page = [r for r in route["routes"] if 'alertname="TensorwatchNonFinite"' in r.get("matchers", [])]
    assert page, "no route for TensorwatchNonFinite"
    # group_wait is added to every first page; keep it to a few seconds.
    assert re.fullmatch(r"[0-5]s", page[0]["group_wait"]), page[0]["group_wait"]


def test_prometheus_config_scrapes_ranks_via_file_sd_and_collector():
    cfg = _load_yaml(PROM_DIR / "prometheus.yml")
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    ranks = jobs["tensorwatch"]
    files = [f for sd in ranks["file_sd_configs"] for f in sd["files"]]
    targets = [t for pattern in files for t in sorted(PROM_DIR.glob(pattern))]
    assert targets, f"no example targets file matches {files}"
    for path in targets:
        for group in _load_yaml(path):
            assert group["targets"], path
            for target in group["targets"]:
                assert re.fullmatch(r"[\w.-]+:\d+", target), target
            # A target label `rank` would clash with the exporter's and be renamed exported_rank.
            assert "rank" not in group.get("labels", {}), path
    # The collector path: its attribute labels are renamed to the direct path's names.
    relabels = jobs["otel-collector"]["metric_relabel_configs"]
    renamed = {r["target_label"]: r["source_labels"][0] for r in relabels if r.get("target_label")}
    assert renamed["module"] == "tensorwatch_module_path"
    assert renamed["module_class"] == "tensorwatch_module_class"
    assert renamed["tensor"] == "tensorwatch_tensor"
    assert renamed["rank"] == "tensorwatch_rank"


# -- docker-compose.yaml ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> Dict[str, Any]:
    return _load_yaml(DEPLOY / "docker-compose.yaml")


def _container_port(service: Dict[str, Any], host_port: int) -> int:
    for spec in service.get("ports", []):
        host, _, container = str(spec).rpartition(":")
        if int(host.rpartition(":")[2]) == host_port:
            return int(container.split("/")[0])
    raise AssertionError(f"host port {host_port} not published")


def test_compose_services_and_pinned_images(compose):
    services = compose["services"]
    assert COMPOSE_SERVICES <= set(services), set(services)
    for name, svc in services.items():
        image = svc["image"]
        repo, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag, f"{name}: image {image!r} has no tag"
        # An explicit version, not latest/main/a floating major.
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: image {image!r} is not pinned to x.y.z"


def test_compose_ports_are_documented_and_well_formed(compose):
    services = compose["services"]
    published = {}
    for name, svc in services.items():
        for spec in svc.get("ports", []):
            assert isinstance(spec, str) and re.fullmatch(r"(\d+):(\d+)(/(tcp|udp))?", spec), (name, spec)
            host = int(spec.split(":")[0])
            assert host not in published, f"host port {host} published twice"
            published[host] = name
    expected = {4317: "otel-collector", 4318: "otel-collector", 9090: "prometheus",
                9093: "alertmanager", 16686: "jaeger", 3000: "grafana"}
    for port, name in expected.items():
        assert published.get(port) == name, (port, published.get(port))
    readme = (DEPLOY / "README.md").read_text()
    for port in expected:
        assert str(port) in readme, f"port {port} not documented in deploy/README.md"


def test_compose_bind_mounts_exist_and_named_volumes_are_declared(compose):
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for spec in svc.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith((".", "/")):
                path = (DEPLOY / source).resolve()
                assert path.exists(), f"{name}: {source} does not exist in deploy/"
                assert DEPLOY in path.parents or path == DEPLOY, f"{name}: {source} outside deploy/"
            else:
                assert source in declared, f"{name}: volume {source} not declared"
        for dep in svc.get("depends_on", []):
            assert dep in compose["services"], (name, dep)


def test_compose_wiring_matches_the_configs(compose):
    """Every service address in the configs is a compose service listening on that port."""
    services = compose["services"]
    prom = _load_yaml(PROM_DIR / "prometheus.yml")
    am_targets = [t for am in prom["alerting"]["alertmanagers"] for sc in am["static_configs"]
                  for t in sc["targets"]]
    assert am_targets == ["alertmanager:9093"]
    assert _container_port(services["alertmanager"], 9093) == 9093
    collector = _load_yaml(DEPLOY / "otel-collector" / "config.yaml")
    prom_exporter_port = int(collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1])
    coll_job = next(j for j in prom["scrape_configs"] if j["job_name"] == "otel-collector")
    assert coll_job["static_configs"][0]["targets"] == [f"otel-collector:{prom_exporter_port}"]
    jaeger_endpoint = collector["exporters"]["otlp/jaeger"]["endpoint"]
    assert jaeger_endpoint.split(":")[0] in services
    # The prometheus service mounts the directory, so the relative rule/target paths resolve.
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    ds = _load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml")
    for d in ds["datasources"]:
        host = re.match(r"https?://([\w-]+):(\d+)", d["url"])
        assert host and host.group(1) in services, d["url"]


# -- OpenTelemetry Collector ---------------------------------------------------------------------

def _component_ids(section: Dict[str, Any]) -> set:
    return set(section or {})


def _check_pipelines(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Every pipeline names defined components only, every defined one is used, memory_limiter first."""
    receivers = _component_ids(cfg.get("receivers"))
    processors = _component_ids(cfg.get("processors"))
    exporters = _component_ids(cfg.get("exporters"))
    service = cfg["service"]
    assert set(service.get("extensions", [])) <= _component_ids(cfg.get("extensions"))
    used: Dict[str, set] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipe in service["pipelines"].items():
        assert name.split("/")[0] in ("traces", "metrics", "logs"), name
        assert pipe.get("receivers") and pipe.get("exporters"), name
        for kind, defined in (("receivers", receivers), ("processors", processors), ("exporters", exporters)):
            missing = set(pipe.get(kind, [])) - defined
            assert not missing, f"pipeline {name} names undefined {kind}: {missing}"
            used[kind].update(pipe.get(kind, []))
        if "memory_limiter" in pipe.get("processors", []):
            assert pipe["processors"][0] == "memory_limiter"
    assert used == {"receivers": receivers, "processors": processors, "exporters": exporters}
    return service["pipelines"]


# OpenTelemetry metric names of the sink (docs/telemetry.md): the per-module ones carry the rank.
OTEL_TENSOR_GAUGES = ("tensorwatch.tensor.abs_max", "tensorwatch.tensor.abs_min", "tensorwatch.tensor.range_used",
                      "tensorwatch.tensor.underflow_ratio", "tensorwatch.tensor.overflow_ratio")
OTEL_RANK_METRICS = ("tensorwatch.nonfinite.events", "tensorwatch.stopped_by_rank.events",
                     "tensorwatch.optimizer.steps_skipped", "tensorwatch.grad_scale")


def _ottl_is_match_dropped(condition: str, name: str) -> bool:
    """Evaluates the one OTTL shape the fleet config uses: [not] IsMatch(name, "regex")."""
    m = re.fullmatch(r'(not )?IsMatch\(name, "(.*)"\)', condition.strip())
    assert m, f"unexpected OTTL condition {condition!r}"
    hit = re.search(m.group(2).encode().decode("unicode_escape"), name) is not None
    return hit != bool(m.group(1))


def test_fleet_collector_config_aggregates_the_rank_away():
    """deploy/otel-collector/fleet.yaml: no Collector binary here, so its structure is checked
    against the components' documented fields (docs/at-scale.md says it was not run)."""
    cfg = _load_yaml(DEPLOY / "otel-collector" / "fleet.yaml")
    pipes = _check_pipelines(cfg)
    procs = cfg["processors"]
    fleet, ranks = pipes["metrics/fleet"]["processors"], pipes["metrics/ranks"]["processors"]
    # resources made identical, then compacted, then batched over one export interval, then aggregated
    order = [fleet.index(p) for p in ("resource/fleet", "groupbyattrs/compact", "batch/fleet",
                                      "metricstransform/fleet")]
    assert order == sorted(order)
    deleted = {a.get("key") or a.get("pattern") for a in procs["resource/fleet"]["attributes"]
               if a["action"] == "delete"}
    assert {"service.instance.id", "tensorwatch.rank", "host.name"} <= deleted
    assert procs["groupbyattrs/compact"] in ({}, None) or not procs["groupbyattrs/compact"].get("keys")
    assert float(procs["batch/fleet"]["timeout"].rstrip("s")) >= 15
    # the two filters split the metrics: tensor gauges to the fleet pipeline, the rest keep their rank
    fleet_filter = procs[next(p for p in fleet if p.startswith("filter/"))]["metrics"]["metric"]
    rank_filter = procs[next(p for p in ranks if p.startswith("filter/"))]["metrics"]["metric"]
    for name in OTEL_TENSOR_GAUGES + OTEL_RANK_METRICS:
        in_fleet = not any(_ottl_is_match_dropped(c, name) for c in fleet_filter)
        in_ranks = not any(_ottl_is_match_dropped(c, name) for c in rank_filter)
        assert in_fleet != in_ranks, name
        assert in_fleet == (name in OTEL_TENSOR_GAUGES), name
    # the per-module magnitude histogram is left out of both (docs/at-scale.md)
    assert any(_ottl_is_match_dropped(c, "tensorwatch.tensor.magnitude") for c in fleet_filter + rank_filter)
    assert all(any(_ottl_is_match_dropped(c, "tensorwatch.tensor.magnitude") for c in f)
               for f in (fleet_filter, rank_filter))
    # every tensor gauge is aggregated, max (min for abs_min), keeping module/class/tensor, not rank
    transforms = procs["metricstransform/fleet"]["transforms"]
    for name in OTEL_TENSOR_GAUGES:
        hits = [t for t in transforms if (re.search(t["include"], name) if t.get("match_type") == "regexp"
                                           else t["include"] == name)]
        assert len(hits) == 1, name
        (op,) = hits[0]["operations"]
        assert op["action"] == "aggregate_labels"
        assert op["aggregation_type"] == ("min" if name.endswith("abs_min") else "max")
        assert {"tensorwatch.module.path", "tensorwatch.module.class", "tensorwatch.tensor"} <= set(op["label_set"])
        assert "tensorwatch.rank" not in op["label_set"]
        assert hits[0]["action"] == "update" and hits[0]["new_name"].startswith("tensorwatch.fleet.tensor.")


def test_collector_pipelines_name_only_defined_components():
    cfg = _load_yaml(DEPLOY / "otel-collector" / "config.yaml")
    receivers = _component_ids(cfg.get("receivers"))
    processors = _component_ids(cfg.get("processors"))
    exporters = _component_ids(cfg.get("exporters"))
    extensions = _component_ids(cfg.get("extensions"))
    service = cfg["service"]
    assert set(service.get("extensions", [])) <= extensions
    used = {"receivers": set(), "processors": set(), "exporters": set()}
    pipelines = service["pipelines"]
    assert {"traces", "metrics"} <= {p.split("/")[0] for p in pipelines}
    for name, pipe in pipelines.items():
        assert name.split("/")[0] in ("traces", "metrics", "logs"), name
        assert pipe.get("receivers") and pipe.get("exporters"), name
        for kind, defined in (("receivers", receivers), ("processors", processors), ("exporters", exporters)):
            missing = set(pipe.get(kind, [])) - defined
            assert not missing, f"pipeline {name} names undefined {kind}: {missing}"
            used[kind].update(pipe.get(kind, []))
    assert used["receivers"] == receivers and used["exporters"] == exporters and used["processors"] == processors
    otlp = cfg["receivers"]["otlp"]["protocols"]
    assert otlp["grpc"]["endpoint"].endswith(":4317") and otlp["http"]["endpoint"].endswith(":4318")
    # Traces go to Jaeger, metrics to the Prometheus exporter.
    assert any(e.startswith("otlp") for e in pipelines["traces"]["exporters"])
    assert "prometheus" in pipelines["metrics"]["exporters"]
    # memory_limiter must come first in each pipeline (the collector's own guidance).
    for pipe in pipelines.values():
        if "memory_limiter" in pipe.get("processors", []):
            assert pipe["processors"][0] == "memory_limiter"


# -- Grafana provisioning and dashboard ----------------------------------------------------------

def test_grafana_provisioning_files():
    ds = _load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml")
    assert ds["apiVersion"] == 1
    by_type = {d["type"]: d for d in ds["datasources"]}
    assert by_type["prometheus"]["uid"] == "prometheus" and by_type["prometheus"].get("isDefault")
    assert by_type["jaeger"]["uid"] == "jaeger"
    # exemplars of the nonfinite counter (label trace_id) open the trace in Jaeger
    dest = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert {"name": "trace_id", "datasourceUid": "jaeger"} in dest
    assert sum(bool(d.get("isDefault")) for d in ds["datasources"]) == 1
    prov = _load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "tensorwatch.yaml")
    assert prov["apiVersion"] == 1
    compose = _load_yaml(DEPLOY / "docker-compose.yaml")
    mounts = {}  # container path -> source
    for v in compose["services"]["grafana"]["volumes"]:
        source, target = v.split(":")[:2]
        mounts[target] = source
    for provider in prov["providers"]:
        assert provider["type"] == "file"
        source = mounts.get(provider["options"]["path"])
        assert source, f"dashboards path {provider['options']['path']} is not mounted"
        assert list((DEPLOY / source).glob("*.json")), f"no dashboards in {source}"


_PANEL_SCHEMA = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos"],
    "properties": {
        "id": {"type": "integer"},
        "type": {"enum": ["row", "stat", "table", "timeseries", "heatmap", "gauge", "bargauge", "text",
                          "traces"]},
        "title": {"type": "string", "minLength": 1},
        "gridPos": {
            "type": "object", "required": ["x", "y", "w", "h"],
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 23},
                           "y": {"type": "integer", "minimum": 0},
                           "w": {"type": "integer", "minimum": 1, "maximum": 24},
                           "h": {"type": "integer", "minimum": 1}},
        },
        "targets": {"type": "array", "items": {"type": "object", "required": ["refId"]}},
    },
}
DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "panels": {"type": "array", "minItems": 1, "items": _PANEL_SCHEMA},
        "templating": {"type": "object", "required": ["list"],
                       "properties": {"list": {"type": "array", "items": {
                           "type": "object", "required": ["name", "type"]}}}},
    },
}
GRAFANA_BUILTINS = {"__all", "__rate_interval", "__interval", "__range", "__interval_ms", "__range_s",
                    "__field", "__data", "__value", "__series", "__from", "__to"}


def _dashboard_targets(dash: Dict[str, Any]) -> Iterator[Tuple[Dict[str, Any], Dict[str, Any]]]:
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


# -- the dashboard's PromQL, shared with test_deploy_e2e ----------------------------------------

# What Grafana would put in for its variables. "All" of a multi-value variable is its allValue.
DEFAULT_VARIABLES = {
    "job": ".*", "rank": ".*", "module": ".*", "service": "tensorwatch-otel",
    "datasource": "prometheus",
    "__rate_interval": "1m", "__interval": "15s", "__range": "5m",
}
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$", re.S)


def substitute(text: str, variables: Dict[str, str]) -> str:
    def repl(m: "re.Match") -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise KeyError(f"no value for Grafana variable ${name} in {text!r}")
        return variables[name]
    return _VAR.sub(repl, text)


def prometheus_queries(dash: Dict[str, Any], variables: Dict[str, str] = DEFAULT_VARIABLES
                       ) -> List[Tuple[str, str]]:
    """(where, PromQL) for every Prometheus query in a dashboard, variables substituted.
    Template variables `label_values(selector, label)` become `group by (label) (selector)`,
    which returns data exactly when Grafana's variable would have values."""
    out: List[Tuple[str, str]] = []
    for panel, target in _dashboard_targets(dash):
        ds = target.get("datasource") or panel.get("datasource") or {}
        if ds.get("type") == "prometheus":
            out.append((f"panel {panel['title']!r} {target['refId']}", substitute(target["expr"], variables)))
    for ann in dash.get("annotations", {}).get("list", []):
        if (ann.get("datasource") or {}).get("type") == "prometheus" and ann.get("expr"):
            out.append((f"annotation {ann['name']!r}", substitute(ann["expr"], variables)))
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query.strip())
        assert m, f"variable {var['name']}: unsupported query {query!r}"
        selector, label = m.groups()
        out.append((f"variable ${var['name']}", substitute(f"group by ({label}) ({selector})", variables)))
    return out


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_shape(path):
    dash = json.loads(path.read_text())
    jsonschema.validate(dash, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        gp = panel["gridPos"]
        assert gp["x"] + gp["w"] <= 24, panel["title"]
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    provisioned = {"prometheus", "jaeger"}
    text = path.read_text()
    for name in set(re.findall(r"\$\{?(\w+)", text)):
        assert name in variables or name in GRAFANA_BUILTINS, f"undefined variable ${name}"
    for panel, target in _dashboard_targets(dash):
        ds = target.get("datasource") or panel.get("datasource")
        assert ds and (ds["uid"] in provisioned or ds["uid"] == "${datasource}"), panel["title"]
        if ds["type"] == "prometheus":
            assert target.get("expr"), panel["title"]
    # Series names in the dashboard's queries are the contract's.
    for where, promql in prometheus_queries(dash):
        for name in set(re.findall(r"\btensorwatch_\w+", promql)):
            assert name in CONTRACT_SERIES, f"{where}: {name} is not a contract series"
    # What the issue asks the dashboard to show.
    kinds = {p["type"] for p in dash["panels"]}
    assert "heatmap" in kinds
    assert "tensorwatch_tensor_range_used_ratio" in text and "float16" in text
    assert "tensorwatch_batches_total" in text and "tensorwatch_batch_number" in text
    assert any("tensorwatch_tensor_underflow_ratio" in t.get("expr", "") and "target_dtype" in t["expr"]
               for p, t in _dashboard_targets(dash)), "no panel for the underflow share (target_dtypes)"
    nonfinite = [p for p, t in _dashboard_targets(dash) if "tensorwatch_nonfinite_events_total" in t.get("expr", "")]
    assert nonfinite and any("by (rank)" in t["expr"] for p, t in _dashboard_targets(dash)
                             if "nonfinite" in t.get("expr", ""))
    links = [link["url"] for p in nonfinite for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])]
    assert any("tensorwatch.nonfinite_detected" in u for u in links), "no link to the spans in Jaeger"
    # Metric -> trace through exemplars (trace_id), not hard-coded host URLs.
    assert "localhost" not in text and "16686" not in text
    assert all(u.startswith("/") for u in links + [link["url"] for link in dash.get("links", [])])
    assert any(t.get("exemplar") for p, t in _dashboard_targets(dash)
               if "tensorwatch_nonfinite_events_total" in t.get("expr", "")), "no exemplar query"
    assert any("first_rank" in t.get("expr", "") and "by (first_rank)" in t["expr"]
               for p, t in _dashboard_targets(dash)), "no panel for the rank that went bad first"
    jaeger_targets = [t for p, t in _dashboard_targets(dash) if (t.get("datasource") or {}).get("type") == "jaeger"]
    assert all(t["operation"] == "tensorwatch.nonfinite_detected" for t in jaeger_targets)


def test_rules_name_only_contract_series():
    texts = [r["expr"] for r in _alert_rules().values()]
    for path in RULE_TESTS:
        for case in _load_yaml(path)["tests"]:
            texts += [s["series"] for s in case.get("input_series", [])]
    for text in texts:
        for name in set(re.findall(r"\btensorwatch_\w+", text)):
            assert name in CONTRACT_SERIES, f"{name} is not a contract series: {text}"


@pytest.mark.slow
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_promql_parses(path, tmp_path):
    """Every PromQL expression (panels, annotations, variables) parses in a real Prometheus.
    Whether each returns data is checked against a real training run in test_deploy_e2e."""
    from prom_server import PrometheusServer

    _tool("prometheus")
    queries = prometheus_queries(json.loads(path.read_text()))
    assert len(queries) >= 8
    with PrometheusServer(tmp_path) as prom:
        for where, promql in queries:
            try:
                prom.query(promql)
            except RuntimeError as exc:
                raise AssertionError(f"{where}: {promql}\n{exc}") from None


# What the collector's Prometheus exporter serves for one run's OTLP metrics (names and labels
# as the exporter derives them from the OTel sink's instruments: dots to underscores, unit
# suffixes, attributes as labels, job/instance from service.name/service.instance.id).
_COLLECTOR_EXPOSITION = """\
# TYPE tensorwatch_nonfinite_events_total counter
tensorwatch_nonfinite_events_total{job="tensorwatch-otel",instance="3",otel_scope_name="tensorwatch_otel",tensorwatch_module_path="blocks.1.mlp.fc1",tensorwatch_module_class="Linear",tensorwatch_tensor="output",tensorwatch_rank="3",tensorwatch_first_rank="1"} 1
# TYPE tensorwatch_tensor_abs_max_ratio gauge
tensorwatch_tensor_abs_max_ratio{job="tensorwatch-otel",instance="3",otel_scope_name="tensorwatch_otel",tensorwatch_module_path="blocks.1.mlp.fc1",tensorwatch_module_class="Linear",tensorwatch_tensor="output",tensorwatch_rank="3"} 65000
# TYPE tensorwatch_tensor_range_used_ratio gauge
tensorwatch_tensor_range_used_ratio{job="tensorwatch-otel",instance="3",otel_scope_name="tensorwatch_otel",tensorwatch_module_path="blocks.1.mlp.fc1",tensorwatch_module_class="Linear",tensorwatch_tensor="output",tensorwatch_rank="3",tensorwatch_dtype="float16"} 0.99
# TYPE tensorwatch_tensor_underflow_ratio gauge
tensorwatch_tensor_underflow_ratio{job="tensorwatch-otel",instance="3",otel_scope_name="tensorwatch_otel",tensorwatch_module_path="blocks.1.mlp.fc1",tensorwatch_module_class="Linear",tensorwatch_tensor="output",tensorwatch_rank="3",tensorwatch_target_dtype="float8_e4m3fn"} 0.25
"""


@pytest.mark.slow
def test_collector_path_is_relabelled_to_the_direct_names(tmp_path):
    """The shipped otel-collector scrape job, run by a real Prometheus against the collector's
    exposition format, yields the same series and labels the rules and dashboard use."""
    import http.server
    import threading

    from prom_server import PrometheusServer

    _tool("prometheus")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = _COLLECTOR_EXPOSITION.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        prom_cfg = _load_yaml(PROM_DIR / "prometheus.yml")
        job = next(j for j in prom_cfg["scrape_configs"] if j["job_name"] == "otel-collector")
        job["static_configs"] = [{"targets": [f"127.0.0.1:{server.server_address[1]}"]}]
        job["scrape_interval"] = "1s"
        job["scrape_timeout"] = "1s"
        with PrometheusServer(tmp_path, rule_files=RULE_FILES, extra_scrape_configs=[job]) as prom:
            result = prom.wait_for('tensorwatch_nonfinite_events_total{module="blocks.1.mlp.fc1"}', timeout=20)
            labels = result[0]["metric"]
            assert labels["module_class"] == "Linear" and labels["tensor"] == "output"
            assert labels["rank"] == "3" and labels["job"] == "tensorwatch-otel" and labels["first_rank"] == "1"
            assert not any(k.startswith("tensorwatch_") for k in labels), labels
            assert prom.query('tensorwatch_tensor_abs_max{module="blocks.1.mlp.fc1", rank="3"}')
            assert not prom.query('{__name__=~"tensorwatch_tensor_abs_max_ratio"}')
            assert prom.query('tensorwatch_tensor_range_used_ratio{dtype="float16", rank="3"}')
            assert prom.query('tensorwatch_tensor_underflow_ratio{target_dtype="float8_e4m3fn", rank="3", '
                              'module="blocks.1.mlp.fc1"}')
            # And the page fires on this path too, with the contract labels.
            alerts = prom.wait_for('ALERTS{alertname="TensorwatchNonFinite", alertstate="firing"}', timeout=20)
            assert {"module", "module_class", "tensor", "rank", "severity"} <= set(alerts[0]["metric"])
    finally:
        server.shutdown()
        server.server_close()


# -- Jaeger v2 ------------------------------------------------------------------------------------

def test_jaeger_v2_config_and_wiring(compose):
    """Jaeger v2 (the v1 all-in-one is end of life): its own config, OTLP in on the port the
    collector exports to, the query service on the port compose publishes and Grafana uses."""
    jaeger = compose["services"]["jaeger"]
    repo, _, tag = jaeger["image"].rpartition(":")
    assert repo == "jaegertracing/jaeger" and tag.startswith("2."), jaeger["image"]
    assert "environment" not in jaeger or "COLLECTOR_OTLP_ENABLED" not in jaeger["environment"]
    mounts = dict(v.split(":")[:2] for v in jaeger["volumes"])
    config_in_container = next(a.split("=", 1)[1] for a in jaeger["command"] if a.startswith("--config="))
    source = {target: src for src, target in mounts.items()}[config_in_container]
    cfg = _load_yaml((DEPLOY / source).resolve())
    assert (DEPLOY / source).resolve() == DEPLOY / "jaeger" / "config.yaml"
    service = cfg["service"]
    assert set(service["extensions"]) <= set(cfg["extensions"])
    assert {"jaeger_storage", "jaeger_query"} <= set(service["extensions"])
    traces = service["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(traces.get(kind, [])) <= set(cfg.get(kind) or {}), kind
    assert traces["exporters"] == ["jaeger_storage_exporter"]
    backends = set(cfg["extensions"]["jaeger_storage"]["backends"])
    assert cfg["exporters"]["jaeger_storage_exporter"]["trace_storage"] in backends
    assert cfg["extensions"]["jaeger_query"]["storage"]["traces"] in backends
    # OTLP gRPC on the port the collector's otlp/jaeger exporter targets
    collector = _load_yaml(DEPLOY / "otel-collector" / "config.yaml")
    host, port = collector["exporters"]["otlp/jaeger"]["endpoint"].rsplit(":", 1)
    assert host == "jaeger"
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":" + port)
    # the query UI/API where compose publishes it and where Grafana's datasource points
    query_port = int(cfg["extensions"]["jaeger_query"]["http"]["endpoint"].rsplit(":", 1)[1])
    assert _container_port(jaeger, 16686) == query_port
    ds = _load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml")
    jaeger_ds = next(d for d in ds["datasources"] if d["type"] == "jaeger")
    assert jaeger_ds["url"] == f"http://jaeger:{query_port}"


def test_exemplars_reach_prometheus_on_both_paths(compose):
    """Prometheus stores exemplars, and the collector serves OpenMetrics so they survive it."""
    assert "--enable-feature=exemplar-storage" in compose["services"]["prometheus"]["command"]
    collector = _load_yaml(DEPLOY / "otel-collector" / "config.yaml")
    assert collector["exporters"]["prometheus"].get("enable_open_metrics") is True
