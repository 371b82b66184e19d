"""API keys from Secrets and the engines' NetworkPolicy, as the operator renders them (issue 11, item 7).

Before: the router's key could only be set in ``spec.router.args``, so it was stored in the InferenceService, the
ConfigMap and the pod spec, and engines were open to any pod. Now ``apiKeySecretRef`` becomes env vars read from the
Secret by the kubelet (the operator never sees a key), checked here by resolving them as the kubelet would and parsing
the rendered command lines with the engine's and router's own parsers; ``networkPolicy`` selects exactly the pods the
operator renders. What the API server does with them is in tests/test_operator_kopf.py (the emulator).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from radixserve.contracts import constants
from radixserve.operator import crd as crd_mod
from radixserve.operator.render import (
    API_KEY_ENV,
    ENGINE_API_KEY_ENV,
    ENGINE_CONTAINER,
    ROUTER_CONTAINER,
    RenderOptions,
    render_children,
)
from radixserve.operator.spec import InferenceService

from crd_validation import validate_custom_object

NS = "ml"
NAME = "chat"
OPTIONS = RenderOptions(image="radixserve:test")
# What `kubectl create secret generic ...` made: name -> data (decoded).
SECRETS = {"chat-api-key": {"api-key": "sk-client-7f3a"}, "chat-engine-key": {"token": "sk-engine-91c2"}}
SECURED: dict[str, Any] = {
    "model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"},
    "engine": {"apiKeySecretRef": {"name": "chat-engine-key", "key": "token"}},
    "router": {"apiKeySecretRef": {"name": "chat-api-key"}},  # key defaults to "api-key"
    "networkPolicy": {"enabled": True, "metricsNamespaces": ["monitoring"]},
}


def isvc_body(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{constants.API_GROUP}/{constants.API_VERSION}",
        "kind": constants.CRD_KIND,
        "metadata": {"name": NAME, "namespace": NS, "uid": "0d9e5c1a-5b7e-4b8f-9c61-7e2f3a4b5c6d"},
        "spec": copy.deepcopy(spec),
    }


def render(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    children = render_children(InferenceService.model_validate(isvc_body(spec)), OPTIONS)
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def pod_container(children: dict[tuple[str, str], dict[str, Any]], deployment: str, name: str) -> dict[str, Any]:
    pod = children[("Deployment", deployment)]["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == name]
    return c


def kubelet_env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: values, and secretKeyRefs looked up in ``secrets``
    (a missing non-optional Secret or key is CreateContainerConfigError: KeyError here)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["optional"] is False
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def parse_in_pod(container: dict[str, Any], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The container's command line parsed by `radixserve` with exactly ``env`` for the key variables."""
    from radixserve.launch.cli import build_parser

    for var in (API_KEY_ENV, ENGINE_API_KEY_ENV, constants.SHUTDOWN_TIMEOUT_ENV):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return build_parser().parse_args(container["args"])  # defaults read from the environment at build time


# --- API keys -------------------------------------------------------------------------------------------------------


def test_the_keys_reach_engine_and_router_from_the_secrets(monkeypatch):
    from radixserve.engine.config import API_KEY_ENV as ENGINE_READS
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.router.config import API_KEY_ENV as ROUTER_READS
    from radixserve.router.config import ENGINE_API_KEY_ENV as ROUTER_READS_ENGINE
    from radixserve.router.config import router_args_from_namespace

    assert (API_KEY_ENV, ENGINE_API_KEY_ENV) == (ENGINE_READS, ROUTER_READS_ENGINE) and API_KEY_ENV == ROUTER_READS
    children = render(SECURED)
    engine = pod_container(children, constants.engine_deployment_name(NAME), ENGINE_CONTAINER)
    router = pod_container(children, constants.router_deployment_name(NAME), ROUTER_CONTAINER)
    drain = {"name": constants.SHUTDOWN_TIMEOUT_ENV, "value": "30"}  # not a secret: the graceful drain's bound
    assert engine["env"] == [
        {
            "name": API_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": "chat-engine-key", "key": "token", "optional": False}},
        },
        drain,
    ]
    assert router["env"] == [
        {
            "name": API_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": "chat-api-key", "key": "api-key", "optional": False}},
        },
        {
            "name": ENGINE_API_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": "chat-engine-key", "key": "token", "optional": False}},
        },
        drain,
    ]
    e = engine_args_from_namespace(parse_in_pod(engine, kubelet_env(engine, SECRETS), monkeypatch))
    assert e.api_key == "sk-engine-91c2"
    r = router_args_from_namespace(parse_in_pod(router, kubelet_env(router, SECRETS), monkeypatch))
    assert (r.api_key, r.engine_api_key) == ("sk-client-7f3a", "sk-engine-91c2")
    assert r.shutdown_timeout == 30.0


def test_an_engine_key_alone_is_only_the_routers_engine_key():
    """Engines behind a key, router open to clients (ClusterIP): the router must still call the engines with it."""
    children = render({**SECURED, "router": {}})
    router = pod_container(children, constants.router_deployment_name(NAME), ROUTER_CONTAINER)
    assert [v["name"] for v in router["env"]] == [ENGINE_API_KEY_ENV, constants.SHUTDOWN_TIMEOUT_ENV]
    plain = render({"model": SECURED["model"]})
    for dep, c in (
        (constants.engine_deployment_name(NAME), ENGINE_CONTAINER),
        (constants.router_deployment_name(NAME), ROUTER_CONTAINER),
    ):
        assert [v["name"] for v in pod_container(plain, dep, c)["env"]] == [constants.SHUTDOWN_TIMEOUT_ENV]


def _paths_of(value: Any, needle: str, path: str = "") -> list[str]:
    """JSON paths of every string in ``value`` that contains ``needle`` (in parsed JSON strings too)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _paths_of(v, needle, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _paths_of(v, needle, f"{path}[{i}]")]
    if isinstance(value, str) and needle in value:
        try:
            inner = json.loads(value)
        except ValueError:
            return [path]
        return _paths_of(inner, needle, path + "<json>") if isinstance(inner, (dict, list)) else [path]
    return []


def test_secrets_are_named_only_in_env_and_no_key_flag_is_rendered():
    children = render(SECURED)
    for (kind, name), obj in children.items():
        for secret in SECRETS:
            for path in _paths_of(obj, secret):
                assert path.endswith(".valueFrom.secretKeyRef.name") and ".env[" in path, (kind, name, path)
        for flag in ("--api-key", "--engine-api-key"):
            assert _paths_of(obj, flag) == [], (kind, name)
    config = children[("ConfigMap", f"{NAME}-config")]["data"]
    assert not any(s in json.dumps(config) for s in SECRETS)


def test_secret_refs_validate_in_the_crd_and_bad_names_are_refused():
    crd = crd_mod.build_crd()
    assert validate_custom_object(isvc_body(SECURED), crd) == []
    bad = copy.deepcopy(SECURED)
    bad["router"]["apiKeySecretRef"] = {"name": "Chat_Key", "key": "a key"}
    errors = validate_custom_object(isvc_body(bad), crd)
    assert any("apiKeySecretRef.name" in e for e in errors) and any("apiKeySecretRef.key" in e for e in errors)
    with pytest.raises(Exception, match="apiKeySecretRef|api_key_secret_ref"):
        InferenceService.model_validate(isvc_body(bad))


@pytest.mark.parametrize(
    ("engine_args", "router_args", "found"),
    [
        ([], ["--api-key", "sk-plain"], ["spec.router.args --api-key"]),
        ([], ["--engine-api-key=sk-e"], ["spec.router.args --engine-api-key"]),
        (["--api-key", "sk-e"], ["--max-retries", "3"], ["spec.engine.args --api-key"]),
        ([], ["--api-key-file", "x"], []),  # not a key flag
        ([], [], []),
    ],
)
def test_key_flags_in_args_are_found(engine_args, router_args, found):
    spec = {"model": SECURED["model"], "engine": {"args": engine_args}, "router": {"args": router_args}}
    assert InferenceService.model_validate(isvc_body(spec)).spec.plain_text_keys() == found


# --- NetworkPolicy --------------------------------------------------------------------------------------------------


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_network_policy_is_off_by_default():
    assert not [k for k in render({"model": SECURED["model"]}) if k[0] == "NetworkPolicy"]


@pytest.mark.parametrize("version", ("1.29.0", "1.33.0"))
def test_network_policy_admits_only_the_router_pods_and_the_metrics_namespaces(version):
    children = render(SECURED)
    policy = children[("NetworkPolicy", constants.engine_deployment_name(NAME))]
    kubernetes_validate.validate(policy, version, strict=True)
    assert policy["metadata"]["ownerReferences"][0]["name"] == NAME  # deleted with the InferenceService
    engine_pod = children[("Deployment", constants.engine_deployment_name(NAME))]["spec"]["template"]
    router_pod = children[("Deployment", constants.router_deployment_name(NAME))]["spec"]["template"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert _selects(selector, engine_pod["metadata"]["labels"])
    assert not _selects(selector, router_pod["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open: hf:// downloads
    from_router, from_operator, from_metrics = policy["spec"]["ingress"]
    (peer,) = from_router["from"]
    assert set(peer) == {"podSelector"}  # same namespace only: no namespaceSelector
    assert _selects(peer["podSelector"]["matchLabels"], router_pod["metadata"]["labels"])
    assert not _selects(peer["podSelector"]["matchLabels"], engine_pod["metadata"]["labels"])
    (metrics_peer,) = from_metrics["from"]
    assert metrics_peer == {
        "namespaceSelector": {
            "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]
        }
    }
    # The operator's pods (any namespace: the chart's release namespace) read the engines' /metrics (cache heat).
    (operator_peer,) = from_operator["from"]
    assert operator_peer["namespaceSelector"] == {}
    assert operator_peer["podSelector"]["matchLabels"] == {
        constants.LABEL_NAME: constants.LABEL_NAME_VALUE,
        constants.LABEL_COMPONENT: constants.COMPONENT_OPERATOR,
    }
    assert not _selects(operator_peer["podSelector"]["matchLabels"], router_pod["metadata"]["labels"])
    (engine_c,) = engine_pod["spec"]["containers"]
    for rule in (from_router, from_operator, from_metrics):
        assert rule["ports"] == [{"protocol": "TCP", "port": engine_c["ports"][0]["containerPort"]}]
    # Another InferenceService's router in the namespace does not match the label selector.
    other = render_children(
        InferenceService.model_validate({**isvc_body(SECURED), "metadata": {"name": "other", "namespace": NS}}),
        OPTIONS,
    )
    (other_router,) = [
        c
        for c in other
        if c["kind"] == "Deployment" and c["metadata"]["name"] == constants.router_deployment_name("other")
    ]
    assert not _selects(peer["podSelector"]["matchLabels"], other_router["spec"]["template"]["metadata"]["labels"])


def test_network_policy_without_metrics_namespaces_admits_the_router_and_the_operator_only():
    spec = {**SECURED, "networkPolicy": {"enabled": True}}
    router, operator = render(spec)[("NetworkPolicy", constants.engine_deployment_name(NAME))]["spec"]["ingress"]
    assert set(router["from"][0]) == {"podSelector"}
    assert operator["from"][0]["podSelector"]["matchLabels"][constants.LABEL_COMPONENT] == constants.COMPONENT_OPERATOR


def test_the_chart_operator_pods_match_the_network_policy_operator_peer():
    from helm import helm_template

    (peer,) = render(SECURED)[("NetworkPolicy", constants.engine_deployment_name(NAME))]["spec"]["ingress"][1]["from"]
    (operator,) = [o for o in helm_template() if o["kind"] == "Deployment"]
    assert _selects(peer["podSelector"]["matchLabels"], operator["spec"]["template"]["metadata"]["labels"])


# --- docs/kubernetes.md, section 6 ----------------------------------------------------------------------------------


def _exposure_section() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "kubernetes.md").read_text()
    start = text.index("## 6. Exposure, auth and TLS")
    return text[start : text.index("\n## ", start + 1)]


def test_the_docs_ingress_and_route_send_v1_to_the_router_service():
    section = _exposure_section()
    docs = [d for block in re.findall(r"```yaml\n(.*?)```", section, re.S) for d in yaml.safe_load_all(block)]
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Ingress", "Gateway", "HTTPRoute"}
    kubernetes_validate.validate(by_kind["Ingress"], "1.33.0", strict=True)
    # The backends are the router Service of InferenceService "chat" on the port the operator gives it.
    service = render({"model": SECURED["model"]})  # InferenceService "chat"
    (port,) = service[("Service", constants.router_service_name(NAME))]["spec"]["ports"]
    rule = by_kind["Ingress"]["spec"]["rules"][0]["http"]["paths"][0]
    assert rule["path"] == "/v1" and rule["backend"]["service"] == {"name": NAME, "port": {"number": port["port"]}}
    assert by_kind["Ingress"]["spec"]["tls"]
    (route_rule,) = by_kind["HTTPRoute"]["spec"]["rules"]
    assert route_rule["backendRefs"] == [{"name": NAME, "port": port["port"]}]
    assert route_rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert by_kind["Gateway"]["spec"]["listeners"][0]["tls"]["mode"] == "Terminate"
    for words in ("ClusterIP", "apiKeySecretRef", "NetworkPolicy", "not encrypted", "APIKeyInPlainText"):
        assert words in section, words
