"""The Helm chart (charts/radixserve), rendered by a real helm v3 binary (`make tools` fetches it into .tools/bin).

Without .tools/bin/helm these tests skip locally and FAIL in CI (env CI set): see tests/helm.py.
Builtin kinds are validated against the real Kubernetes OpenAPI schemas (kubernetes-validate, strict) for 1.29 and
1.33; custom kinds structurally (ServiceMonitor/PodMonitor) or by the API's own models and the CRD (InferenceService).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from typing import Any

import kubernetes_validate
import pytest
import yaml

from radixserve.contracts import constants
from radixserve.operator import spec as isvc_spec
from radixserve.operator.render import CHILD_TYPES, RenderOptions, render_children

from crd_validation import validate_custom_object
from helm import CHART_DIR, ROOT, HelmError, helm_bin, helm_lint, helm_template, run_helm

pytestmark = pytest.mark.timeout(300)

KUBE_VERSIONS = ("1.29.0", "1.33.0")
NAMESPACE = "radixserve"
ALL_VALUES_PATH = os.path.join(CHART_DIR, "ci", "all-values.yaml")
PODMONITOR_VALUES_PATH = os.path.join(CHART_DIR, "ci", "podmonitor-values.yaml")
DEMO_EXAMPLE_PATH = os.path.join(ROOT, "examples", "inferenceservice-demo.yaml")
CUSTOM_GROUPS = ("monitoring.coreos.com", constants.API_GROUP)
OPERATOR_PORT_NAME = "metrics"
# Cluster-scoped resources the operator may read cluster-wide in every mode (CRD discovery, namespace scanning).
CLUSTER_SCOPED_RESOURCES = {"customresourcedefinitions", "namespaces"}
PROMETHEUS_DURATION = re.compile(r"^([0-9]+(ms|s|m|h))+$")
METRIC_NAME = re.compile(r"radixserve_(engine|router|operator)_\w+")


def all_values() -> dict[str, Any]:
    with open(ALL_VALUES_PATH) as f:
        return yaml.safe_load(f)


def all_values_podmonitor() -> dict[str, Any]:
    """ci/all-values.yaml with ci/podmonitor-values.yaml on top (helm -f a -f b merges maps the same way)."""
    values = all_values()
    with open(PODMONITOR_VALUES_PATH) as f:
        values["metrics"] = yaml.safe_load(f)["metrics"]
    return values


def project_version() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def operator_deployment(objs: list[dict]) -> dict:
    deps = [
        o for o in by_kind(objs, "Deployment") if o["metadata"]["labels"].get(constants.LABEL_COMPONENT) == "operator"
    ]
    assert len(deps) == 1, deps
    return deps[0]


def operator_container(objs: list[dict]) -> dict:
    (container,) = operator_deployment(objs)["spec"]["template"]["spec"]["containers"]
    return container


def rbac_rules(objs: list[dict]) -> list[tuple[str, dict]]:
    """(kind/namespace/name, rule) for every rule of every Role and ClusterRole."""
    out = []
    for o in objs:
        if o["kind"] in ("Role", "ClusterRole"):
            where = f"{o['kind']}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}"
            out += [(where, rule) for rule in o.get("rules") or []]
    return out


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) the rules grant."""
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def example_values(**example: Any) -> dict[str, Any]:
    return {"example": {"enabled": True, **example}}


# Renders shared by several tests (helm runs ~0.2 s each; the 2-core box is shared).
@pytest.fixture(scope="module")
def default_objs() -> list[dict]:
    return helm_template()


@pytest.fixture(scope="module")
def all_objs() -> list[dict]:
    return helm_template(all_values(), namespace="ops")


# --- the binary and lint -------------------------------------------------------------------------------------------


def test_helm_is_v3():
    out = subprocess.run([helm_bin(), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("v3."), out.stdout


def test_missing_helm_skips_locally_and_fails_in_ci(monkeypatch, tmp_path):
    import helm

    monkeypatch.setattr(helm, "HELM_PATH", str(tmp_path / "no-helm"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make tools"):
        helm.helm_bin()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run the chart tests"):
        helm.helm_bin()


def test_fetch_tools_is_idempotent():
    """A second run with the tools in place verifies their versions and downloads nothing."""
    helm_bin()
    proc = subprocess.run(
        [os.path.join(ROOT, "scripts", "fetch_tools.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "already in .tools/bin" in proc.stdout


@pytest.mark.parametrize(
    "values", [None, "all", "podmonitor", "namespaced"], ids=["default", "all-options", "podmonitor", "namespaced"]
)
def test_lint_strict(values):
    vals = {
        "all": all_values(),
        "podmonitor": all_values_podmonitor(),
        "namespaced": {"operator": {"watchNamespaces": ["a", "b"]}},
    }.get(values)
    proc = helm_lint(vals)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_chart_versions_follow_the_project():
    with open(os.path.join(CHART_DIR, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project_version()


# --- rendering validates against Kubernetes' schemas ---------------------------------------------------------------


def check_custom_object(obj: dict, crds: dict[str, dict]) -> None:
    group = obj["apiVersion"].split("/")[0]
    if group == "monitoring.coreos.com":
        check_monitor(obj)
    elif obj["kind"] == constants.CRD_KIND:
        parsed = isvc_spec.InferenceService.model_validate(obj)
        isvc_spec.check_name(parsed.metadata.name)
        crd = crds[f"{constants.CRD_PLURAL}.{constants.API_GROUP}"]
        assert validate_custom_object(obj, crd) == []
    else:
        pytest.fail(f"unexpected custom kind {obj['apiVersion']} {obj['kind']}")


def check_monitor(obj: dict) -> None:
    """The fields the Prometheus Operator needs, with the types its CRD declares (monitoring.coreos.com/v1)."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert obj["kind"] in ("ServiceMonitor", "PodMonitor")
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    spec = obj["spec"]
    endpoints_key = "endpoints" if obj["kind"] == "ServiceMonitor" else "podMetricsEndpoints"
    assert set(spec) == {"selector", "namespaceSelector", endpoints_key}
    assert spec["selector"] == {"matchLabels": {constants.LABEL_NAME: constants.LABEL_NAME_VALUE}}
    ns_sel = spec["namespaceSelector"]
    assert ns_sel == {"any": True} or (
        set(ns_sel) == {"matchNames"} and all(isinstance(n, str) for n in ns_sel["matchNames"])
    )
    for ep in spec[endpoints_key]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout"}, ep
        assert isinstance(ep["port"], str) and ep["path"] == "/metrics"
        assert PROMETHEUS_DURATION.match(ep["interval"]) and PROMETHEUS_DURATION.match(ep["scrapeTimeout"])
    assert {ep["port"] for ep in spec[endpoints_key]} == {constants.HTTP_PORT_NAME, OPERATOR_PORT_NAME}


def validate_all(objs: list[dict], kube_version: str) -> None:
    crds = {o["metadata"]["name"]: o for o in objs if o["kind"] == "CustomResourceDefinition"}
    for obj in objs:
        where = f"{obj['kind']} {obj['metadata'].get('name')}"
        if obj["apiVersion"].split("/")[0] in CUSTOM_GROUPS:
            check_custom_object(obj, crds)
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.absolute_path)
            pytest.fail(f"{where} invalid for Kubernetes {kube_version}: {e.message} at {path}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{where}: no Kubernetes {kube_version} schema for {obj['apiVersion']} {obj['kind']}")


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [None, "all", "podmonitor"], ids=["default", "all-options", "podmonitor"])
def test_rendered_objects_validate(kube_version, values):
    vals = {"all": all_values, "podmonitor": all_values_podmonitor}[values]() if values else None
    objs = helm_template(vals, kube_version=kube_version, include_crds=True)
    kinds = {o["kind"] for o in objs}
    expected = {
        "CustomResourceDefinition",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Service",
    }
    if values:
        monitor = "ServiceMonitor" if values == "all" else "PodMonitor"
        expected |= {"Role", "RoleBinding", monitor, "ConfigMap", constants.CRD_KIND}
        assert not kinds & ({"ServiceMonitor", "PodMonitor"} - {monitor})  # one monitor: targets scraped once
    assert expected <= kinds, expected - kinds
    validate_all(objs, kube_version)


def test_crds_only_with_include_crds(default_objs):
    crd = one(default_objs, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == f"{constants.CRD_PLURAL}.{constants.API_GROUP}"
    assert crd["spec"]["group"] == constants.API_GROUP
    assert constants.CRD_SHORT_NAME in crd["spec"]["names"]["shortNames"]
    assert not by_kind(helm_template(include_crds=False), "CustomResourceDefinition")


def test_kube_version_below_the_floor_is_refused():
    with pytest.raises(HelmError, match="kubeVersion"):
        helm_template(kube_version="1.28.0")


# --- values.schema.json ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"operater": {"replicas": 1}}, "operater"),  # typo'd top-level key
        ({"operator": {"resyncSecond": 30}}, "resyncSecond"),  # typo'd nested key
        ({"metrics": {"serviceMonitor": {"enable": True}}}, "enable"),
        ({"operator": {"resyncSeconds": "60"}}, "resyncSeconds"),  # wrong type
        ({"operator": {"watchNamespaces": "team-a"}}, "watchNamespaces"),  # a string, not a list
        ({"operator": {"logLevel": "verbose"}}, "logLevel"),
        ({"operator": {"replicas": 2}}, "replicas"),  # one writer
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"operator": {"watchNamespaces": ["Team_A"]}}, "watchNamespaces"),
    ],
)
def test_values_schema_refuses(values, needle):
    with pytest.raises(HelmError) as err:
        helm_template(values)
    assert "values don't meet the specifications of the schema" in err.value.output
    assert needle in err.value.output
    proc = helm_lint(values)
    assert proc.returncode != 0 and needle in proc.stdout + proc.stderr


# --- RBAC ------------------------------------------------------------------------------------------------------------


def test_all_namespaces_uses_cluster_roles(default_objs):
    assert not by_kind(default_objs, "Role") and not by_kind(default_objs, "RoleBinding")
    args = operator_container(default_objs)["args"]
    assert "--all-namespaces" in args and "--namespace" not in args
    sa = one(default_objs, "ServiceAccount")["metadata"]
    for binding in by_kind(default_objs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}]
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in by_kind(default_objs, "ClusterRole")}


def test_watch_namespaces_renders_roles_and_no_cluster_access_to_namespaced_kinds():
    objs = helm_template({"operator": {"watchNamespaces": ["a", "b"]}})
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    bindings = by_kind(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    sa_name = one(objs, "ServiceAccount")["metadata"]["name"]
    for b in bindings:
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}]
    for cr in by_kind(objs, "ClusterRole"):
        resources = {r for rule in cr["rules"] for r in rule["resources"]}
        assert resources <= CLUSTER_SCOPED_RESOURCES, f"{cr['metadata']['name']} grants {resources} cluster-wide"
    # Same rules in the Roles as cluster-wide in all-namespaces mode.
    default_objs = helm_template()
    cluster = granted([rule for _, rule in rbac_rules(default_objs)])
    for role in roles:
        assert granted(role["rules"]) | granted(by_kind(objs, "ClusterRole")[0]["rules"]) == cluster
    args = operator_container(objs)["args"]
    assert "--all-namespaces" not in args
    assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == ["a", "b"]


@pytest.mark.parametrize("values", [None, "all"], ids=["default", "namespaced"])
def test_rbac_has_no_wildcards(values):
    objs = helm_template(all_values() if values else None)
    rules = rbac_rules(objs)
    assert rules
    for where, rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert rule.get(field), f"{where}: rule without {field}: {rule}"
            assert not any("*" in item for item in rule[field]), f"{where}: wildcard in {field}: {rule}"
        assert "nonResourceURLs" not in rule, where


def test_rbac_covers_the_operator_design(default_objs):
    """The calls the operator design implies; tests/test_operator_rbac.py compares with the calls recorded against
    kmock."""
    g = granted([rule for _, rule in rbac_rules(default_objs)])
    crud = ("get", "list", "watch", "create", "patch", "delete")
    needed = {(constants.API_GROUP, constants.CRD_PLURAL, v) for v in ("get", "list", "watch", "patch")}
    needed |= {(constants.API_GROUP, f"{constants.CRD_PLURAL}/status", "patch")}
    needed |= {(constants.API_GROUP, f"{constants.CRD_PLURAL}/finalizers", "update")}  # blockOwnerDeletion
    for child in CHILD_TYPES:  # every kind the operator renders, applies and prunes
        group = child.api_version.rpartition("/")[0]
        needed |= {(group, child.plural, v) for v in crud}
    needed |= {("discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")}
    needed |= {("", "events", "create")}  # kopf posts core/v1 Events (tests/test_operator_rbac.py saw only that)
    needed |= {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
    needed |= {("", "namespaces", v) for v in ("list", "watch")}
    # Cache-aware scale-in: engine pods listed (their /metrics read) and annotated with their pod-deletion-cost.
    needed |= {("", "pods", v) for v in ("list", "patch")}
    assert needed <= g, sorted(needed - g)
    # Least privilege: nothing beyond the design (secrets, nodes, pod get/create/delete, ... are never touched).
    assert g <= needed, sorted(g - needed)


def test_operator_holds_what_it_grants_the_router(default_objs):
    """RBAC escalation prevention: the operator can only create the router's Role if it holds every rule in it."""
    isvc = isvc_spec.InferenceService.model_validate(one(helm_template(example_values()), constants.CRD_KIND))
    router_roles = by_kind(render_children(isvc, RenderOptions(image="radixserve:test")), "Role")
    assert router_roles
    operator_grants = granted([rule for _, rule in rbac_rules(default_objs)])
    for role in router_roles:
        missing = granted(role["rules"]) - operator_grants
        assert not missing, f"operator cannot grant {sorted(missing)} (Role {role['metadata']['name']})"


# --- the operator Deployment -----------------------------------------------------------------------------------------


def test_operator_deployment(default_objs):
    dep = operator_deployment(default_objs)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels[constants.LABEL_NAME] == constants.LABEL_NAME_VALUE
    assert labels[constants.LABEL_COMPONENT] == "operator"
    assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["helm.sh/chart"].startswith("radixserve-")
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    c = operator_container(default_objs)
    image = f"{constants.IMAGE_REPOSITORY}:{project_version()}"
    assert c["image"] == image
    assert c["command"] == ["radixserve"]
    args = c["args"]
    assert args[0] == "operator"
    assert args[args.index("--image") + 1] == image
    assert args[args.index("--metrics-port") + 1] == str(constants.OPERATOR_METRICS_PORT)
    with open(os.path.join(CHART_DIR, "values.yaml")) as f:
        defaults = yaml.safe_load(f)
    assert args[args.index("--resync-seconds") + 1] == str(defaults["operator"]["resyncSeconds"])
    assert args[args.index("--image-pull-policy") + 1] == defaults["image"]["pullPolicy"] == c["imagePullPolicy"]
    assert c["ports"] == [
        {"name": OPERATOR_PORT_NAME, "containerPort": constants.OPERATOR_METRICS_PORT, "protocol": "TCP"}
    ]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": OPERATOR_PORT_NAME}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["serviceAccountName"] == one(default_objs, "ServiceAccount")["metadata"]["name"]
    svc = [
        s
        for s in by_kind(default_objs, "Service")
        if s["metadata"]["labels"].get(constants.LABEL_COMPONENT) == "operator"
    ]
    assert len(svc) == 1 and svc[0]["spec"]["ports"][0]["targetPort"] == OPERATOR_PORT_NAME
    assert svc[0]["spec"]["selector"].items() <= labels.items()


def test_operator_values_reach_the_pod(all_objs):
    vals = all_values()
    c = operator_container(all_objs)
    image = f"{vals['image']['repository']}:{vals['image']['tag']}"
    assert c["image"] == image and c["args"][c["args"].index("--image") + 1] == image
    assert c["imagePullPolicy"] == vals["image"]["pullPolicy"]
    assert c["args"][c["args"].index("--image-pull-policy") + 1] == vals["image"]["pullPolicy"]
    assert c["args"][c["args"].index("--resync-seconds") + 1] == str(vals["operator"]["resyncSeconds"])
    assert c["args"][c["args"].index("--log-level") + 1] == vals["operator"]["logLevel"]
    assert c["resources"] == vals["operator"]["resources"]
    pod = operator_deployment(all_objs)["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
        assert pod[key] == (vals["operator"].get(key) or vals.get(key)), key
    assert pod["serviceAccountName"] == vals["serviceAccount"]["name"]
    assert all(
        o["metadata"]["name"].startswith(vals["fullnameOverride"])
        for o in all_objs
        if o["kind"] not in ("CustomResourceDefinition", constants.CRD_KIND)
    )


def operator_cli_help() -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", "operator", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("values", [None, {"operator": {"watchNamespaces": ["a", "b"]}}], ids=["all", "namespaced"])
def test_operator_args_parse_with_the_cli(values):
    args = operator_container(helm_template(values))["args"]
    flags = sorted({a for a in args if a.startswith("--")})
    help_text = operator_cli_help()
    missing = [f for f in flags if f not in help_text]
    if missing:
        pytest.xfail(
            f"`radixserve operator --help` does not list {missing} yet (src/radixserve/launch/cli.py, issue 5)"
        )
    from radixserve.launch.cli import build_parser

    try:
        ns = build_parser().parse_args(args)
    except SystemExit as e:  # argparse reports the offending flag on stderr
        pytest.fail(f"radixserve {' '.join(args)} does not parse (exit {e.code})")
    parsed = vars(ns)
    assert constants.OPERATOR_METRICS_PORT in parsed.values()
    assert args[args.index("--image") + 1] in parsed.values()
    watched = (values or {}).get("operator", {}).get("watchNamespaces")
    assert watched in parsed.values() if watched else True in parsed.values()


# --- monitoring ------------------------------------------------------------------------------------------------------


def test_monitors_select_what_the_operator_creates(all_objs):
    """Engine/router pods and Services the operator renders carry the monitors' label and a port named http."""
    isvc_body = one(all_objs, constants.CRD_KIND)
    children = render_children(
        isvc_spec.InferenceService.model_validate(isvc_body), RenderOptions(image="radixserve:t")
    )
    podmonitor_objs = helm_template(all_values_podmonitor(), namespace="ops")
    for monitor in (one(all_objs, "ServiceMonitor"), one(podmonitor_objs, "PodMonitor")):
        check_monitor(monitor)
        # watched namespaces plus the release namespace (the operator's own metrics)
        assert sorted(monitor["spec"]["namespaceSelector"]["matchNames"]) == ["ops", "team-a", "team-b"]
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = one(all_objs, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    for obj in children:
        if obj["kind"] == "Service":
            assert selector.items() <= obj["metadata"]["labels"].items(), obj["metadata"]["name"]
            assert constants.HTTP_PORT_NAME in {p.get("name") for p in obj["spec"]["ports"]}
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]
            assert selector.items() <= pod["metadata"]["labels"].items(), obj["metadata"]["name"]
            ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            assert constants.HTTP_PORT_NAME in ports
    # ... and the operator's own pod and Service on the port named "metrics".
    op_labels = operator_deployment(all_objs)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= op_labels.items()


def test_monitors_are_off_by_default_and_any_namespace_when_watching_all(default_objs):
    assert not by_kind(default_objs, "ServiceMonitor") and not by_kind(default_objs, "PodMonitor")
    for kind, key in (("ServiceMonitor", "serviceMonitor"), ("PodMonitor", "podMonitor")):
        objs = helm_template({"metrics": {key: {"enabled": True}}})
        monitor = one(objs, kind)
        check_monitor(monitor)
        assert monitor["spec"]["namespaceSelector"] == {"any": True}


BOTH_MONITORS_REFUSED = (
    "metrics.serviceMonitor and metrics.podMonitor both scrape the engines, routers and operator (every target would "
    "be scraped twice); enable one"
)


def test_service_monitor_and_pod_monitor_are_never_both_rendered():
    """Issue 11: the chart let both scrape every engine, router and operator pod (each target scraped twice, every
    rate doubled in sum() queries). Round 2: the refusal said only "at '/metrics/podMonitor/enabled': value must be
    false" (a values.schema.json rule; helm never shows a schema's description). The template refuses them with the
    reason, with or without schema validation; helm lint shows the same line (as INFO: lint never fails on `fail`)."""
    both = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    with pytest.raises(HelmError) as err:
        helm_template(both)
    assert BOTH_MONITORS_REFUSED in err.value.output and "value must be false" not in err.value.output
    proc = run_helm(["template", "radixserve", str(CHART_DIR), "--skip-schema-validation"], both)
    assert proc.returncode != 0 and BOTH_MONITORS_REFUSED in proc.stderr, proc.stderr
    lint = helm_lint(both)
    assert BOTH_MONITORS_REFUSED in lint.stdout + lint.stderr
    off = {"metrics": {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True}}}
    assert [o["kind"] for o in helm_template(off) if o["kind"].endswith("Monitor")] == ["PodMonitor"]


# --- Grafana dashboard -----------------------------------------------------------------------------------------------

KNOWN_METRICS = (
    {
        constants.ENGINE_METRIC_PREFIX + n
        for n in constants.ENGINE_GAUGES + constants.ENGINE_COUNTERS + constants.ENGINE_HISTOGRAMS
    }
    | {
        constants.ROUTER_METRIC_PREFIX + n
        for n in constants.ROUTER_COUNTERS + constants.ROUTER_GAUGES + constants.ROUTER_HISTOGRAMS
    }
    | {
        constants.OPERATOR_METRIC_PREFIX + n
        for n in constants.OPERATOR_COUNTERS + constants.OPERATOR_GAUGES + constants.OPERATOR_HISTOGRAMS
    }
)


def dashboard_from(objs: list[dict]) -> tuple[dict, dict]:
    cms = [o for o in by_kind(objs, "ConfigMap") if "radixserve.json" in o.get("data", {})]
    assert len(cms) == 1
    return cms[0], json.loads(cms[0]["data"]["radixserve.json"])


def metric_names(expr: str) -> set[str]:
    names = set()
    for m in METRIC_NAME.finditer(expr):
        name = m.group(0)
        for suffix in ("_bucket", "_sum", "_count"):
            name = name.removesuffix(suffix)
        names.add(name)
    return names


def test_dashboard_uses_only_contract_metrics(all_objs):
    cm, dash = dashboard_from(all_objs)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used - KNOWN_METRICS == set(), "dashboard metrics missing from src/radixserve/contracts/constants.py"
    # Histogram quantiles read the _bucket series, never the bare histogram name.
    for e in exprs:
        if "histogram_quantile" in e:
            assert re.search(r"_bucket[{\[]", e), e
    # The panels: request rate, TTFT, ITL, cache hit rate, KV usage, queue depth, router decisions.
    wanted = {
        constants.ROUTER_METRIC_PREFIX + n
        for n in (
            "requests_total",
            "ttft_seconds",
            "decisions_total",
            "retries_total",
            "ejections_total",
            "predicted_cached_tokens_total",
            "actual_cached_tokens_total",
        )
    }
    wanted |= {
        constants.ENGINE_METRIC_PREFIX + n
        for n in (
            "num_requests_total",
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "cached_tokens_total",
            "prompt_tokens_total",
            "token_usage",
            "num_used_tokens",
            "max_total_num_tokens",
            "num_queue_reqs",
            "num_running_reqs",
        )
    }
    assert wanted <= used, sorted(wanted - used)


def test_dashboard_variables(all_objs):
    _, dash = dashboard_from(all_objs)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "model_name"} <= variables.keys()
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            # The operator's own series live in the operator's namespace, not the models'.
            if constants.OPERATOR_METRIC_PREFIX not in t["expr"]:
                assert 'namespace=~"$namespace"' in t["expr"], t["expr"]
            if constants.ENGINE_METRIC_PREFIX in t["expr"]:
                assert 'model_name=~"$model_name"' in t["expr"], t["expr"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_dashboard_is_opt_in(default_objs):
    assert not [o for o in by_kind(default_objs, "ConfigMap") if "radixserve.json" in o.get("data", {})]


def test_dashboard_file_is_the_configmap(all_objs):
    _, dash = dashboard_from(all_objs)
    with open(os.path.join(CHART_DIR, "dashboards", "radixserve.json")) as f:
        assert json.load(f) == dash


# --- the example InferenceService ------------------------------------------------------------------------------------


def test_example_is_opt_in_and_serves_the_demo_model(default_objs):
    assert not by_kind(default_objs, constants.CRD_KIND)
    objs = helm_template(example_values())
    isvc = one(objs, constants.CRD_KIND)
    assert isvc["apiVersion"] == f"{constants.API_GROUP}/{constants.API_VERSION}"
    assert isvc["metadata"]["namespace"] == NAMESPACE
    parsed = isvc_spec.InferenceService.model_validate(isvc)
    assert parsed.spec.model.storage_uri == f"demo://{constants.DEMO_MODEL_NAME}"
    assert parsed.spec.served_model_name(parsed.metadata.name) == constants.DEMO_MODEL_NAME
    crd = one(objs, "CustomResourceDefinition")
    assert validate_custom_object(isvc, crd) == []


def test_example_spec_is_the_demo_example_file():
    """Issue 11: the chart's example InferenceService differed from examples/inferenceservice-demo.yaml (other
    resources, no kvCacheTokens): `helm install --set example.enabled=true` and `kubectl apply -f` gave two demos."""
    isvc = one(helm_template(example_values()), constants.CRD_KIND)
    with open(DEMO_EXAMPLE_PATH) as f:
        example = yaml.safe_load(f)
    assert isvc["spec"] == example["spec"]
    assert isvc["apiVersion"] == example["apiVersion"] and isvc["kind"] == example["kind"]


def test_example_spec_errors_are_caught_by_the_api_model():
    """A bad example spec renders (the chart passes it through) but the API model and the CRD refuse it."""
    objs = helm_template(example_values(spec={"model": {"storageUri": "s3://bucket/model"}, "replicas": 1}))
    isvc = one(objs, constants.CRD_KIND)
    with pytest.raises(Exception, match="storage_uri|storageUri"):
        isvc_spec.InferenceService.model_validate(isvc)
    assert validate_custom_object(isvc, one(objs, "CustomResourceDefinition"))


def test_example_outside_the_watched_namespaces_is_refused():
    with pytest.raises(HelmError, match="not in operator.watchNamespaces"):
        helm_template({"operator": {"watchNamespaces": ["team-a"]}, **example_values(namespace="team-b")})
    objs = helm_template({"operator": {"watchNamespaces": ["team-a"]}, **example_values(namespace="team-a")})
    assert one(objs, constants.CRD_KIND)["metadata"]["namespace"] == "team-a"


def render_notes(values: dict[str, Any], tmp_path) -> str:
    """NOTES.txt as helm renders it. `helm template` never shows NOTES and `helm install --dry-run` needs a cluster,
    so render a copy of the chart in which NOTES.txt is a named template included into a ConfigMap."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART_DIR, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes_probe.tpl").write_text('{{- define "notes.probe" }}' + notes + "{{- end }}")
    (chart / "templates" / "notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include "notes.probe" . | toJson }}\n'
    )
    proc = run_helm(
        ["template", "radixserve", str(chart), "--namespace", NAMESPACE, "--show-only", "templates/notes-probe.yaml"],
        values,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["data"]["notes"]


def test_notes_tell_how_to_apply_and_reach_the_router(tmp_path):
    text = render_notes({}, tmp_path / "default")
    assert "all namespaces" in text
    assert f"kind: {constants.CRD_KIND}" in text and f"storageUri: demo://{constants.DEMO_MODEL_NAME}" in text
    assert f"kubectl port-forward svc/chat 8000:{constants.ROUTER_SERVICE_PORT}" in text
    assert 'base_url="http://127.0.0.1:8000/v1"' in text
    text = render_notes(all_values(), tmp_path / "all")
    assert "namespaces team-a, team-b" in text and "kubectl apply -n team-a -f -" in text
    assert "kubectl port-forward -n team-a svc/chat" in text
    assert "example InferenceService chat in namespace team-a" in text
    assert "ServiceMonitor llm" in text and "ConfigMap llm-dashboard" in text


def test_notes_example_is_the_demo_example_file(tmp_path):
    """Issue 11 round 2: the InferenceService the NOTES tell you to apply had no resources and no pool size (engine
    pods without CPU / memory limits, ~2.8 GiB each); it is now the spec of examples/inferenceservice-demo.yaml."""
    text = render_notes({}, tmp_path)
    heredoc = re.search(r"cat <<YAML \| kubectl apply -f -\n(.*?)\n  YAML\n", text, re.S)
    assert heredoc, text
    applied = yaml.safe_load(textwrap.dedent(heredoc.group(1)))
    with open(DEMO_EXAMPLE_PATH) as f:
        example = yaml.safe_load(f)
    assert applied["spec"] == example["spec"]
    assert (applied["apiVersion"], applied["kind"]) == (example["apiVersion"], example["kind"])
    assert applied["spec"]["engine"]["resources"]["limits"]["memory"]  # the point of the regression
    isvc_spec.InferenceService.model_validate({**applied, "metadata": {**applied["metadata"], "namespace": NAMESPACE}})


def test_a_release_name_with_dots_gives_valid_object_names():
    """Helm allows dots in release names; Service names must be DNS-1035 labels (regression: rs.prod rendered the
    metrics Service "rs.prod-radixserve-operator-metrics", which the API server refuses)."""
    out = run_helm(["template", "rs.prod", str(CHART_DIR), "--namespace", "x"])
    assert out.returncode == 0, out.stderr
    for obj in yaml.safe_load_all(out.stdout):
        if obj:
            kubernetes_validate.validate(obj, "1.33.0", strict=True)
            if obj["kind"] == "Service":
                assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"]), obj["metadata"]["name"]
