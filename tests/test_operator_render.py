"""operator/render.py: every rendered child validates against the real Kubernetes OpenAPI schemas (1.29 and 1.33,
strict), carries the shared names/labels/ports, and meets the engine's and router's own parsers and the router's
EndpointSlice discovery; changes touch only the objects they should; output is deterministic."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest

from radixserve.contracts import constants
from radixserve.operator.render import (
    CHILD_TYPES,
    CONFIG_HASH_ANNOTATION,
    ENGINE_CONTAINER,
    MODEL_INIT_CONTAINER,
    ROUTER_CONTAINER,
    RUN_AS_USER,
    RenderOptions,
    child_labels,
    config_map_name,
    engine_selector,
    render_children,
)
from radixserve.operator.spec import AUTOSCALING_METRIC_NAMES, ROUTER_POLICIES, InferenceService

K8S_VERSIONS = ("1.29.0", "1.33.0")
NS = "ml"
UID = "5b0e4a8c-3f0e-4c39-9a57-2b7d1f6e0c11"
OPTIONS = RenderOptions(image="registry.example/radixserve:0.5.0")

SPECS: dict[str, dict[str, Any]] = {
    "demo": {"model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"}},
    "hf-token": {
        "model": {
            "storageUri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main",
            "hfTokenSecret": "hf-token",
            "contextLength": 4096,
        },
        "engine": {"resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "6Gi"}}},
    },
    "hf-no-revision": {"model": {"storageUri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}},
    "pvc": {
        "model": {
            "storageUri": "pvc://models/llama/3b",
            "servedModelName": "llama-3b",
            "tokenizer": "/mnt/models/llama/tokenizer",
        }
    },
    "pvc-root": {"model": {"storageUri": "pvc://weights"}},
    "long-drain": {"model": {"storageUri": "pvc://weights"}, "shutdownTimeoutSeconds": 900},
    "file": {"model": {"storageUri": "file:///opt/models/qwen"}, "engine": {"imagePullPolicy": "Always"}},
    "gpu-placement": {
        "model": {"storageUri": "pvc://models/qwen-7b"},
        "engine": {
            "image": "registry.example/radixserve-gpu:0.5.0",
            "dtype": "bfloat16",
            "kvCacheTokens": 200000,
            "resources": {
                "requests": {"cpu": "4000m", "memory": "32Gi"},
                "limits": {"nvidia.com/gpu": 1, "memory": "32Gi"},
            },
        },
        "replicas": 3,
        "placement": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 60},
            ],
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {constants.LABEL_INFERENCE_SERVICE: "x"}},
                            },
                        }
                    ]
                }
            },
            "priorityClassName": "inference-high",
        },
    },
    "autoscale-queue": {
        "model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 8, "metric": "queue", "targetPerPod": 4},
    },
    "autoscale-tokens": {
        "model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"},
        "autoscaling": {
            "maxReplicas": 4,
            "metric": "tokensInFlight",
            "targetPerPod": 20000,
            "scaleDownDelaySeconds": 0,
        },
    },
    "pdb-off": {"model": {"storageUri": "file:///models/m"}, "disruptionBudget": {"enabled": False}},
    "pdb-percent": {"model": {"storageUri": "file:///models/m"}, "disruptionBudget": {"maxUnavailable": "50%"}},
    "extra-args": {
        "model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"},
        "engine": {"args": ["--max-running-requests", "32", "--disable-radix-cache"], "schedulePolicy": "fcfs"},
        "router": {
            "args": ["--max-retries", "3", "--log-level", "debug"],
            "replicas": 2,
            "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
        },
    },
    "router-zero": {"model": {"storageUri": "file:///models/m"}, "router": {"replicas": 0}, "replicas": 0},
    "pull-secrets": {
        "model": {"storageUri": "hf://org/repo"},
        "imagePullSecrets": ["regcred", "mirror.creds"],
        "engine": {"resources": {"limits": {"cpu": "1500m", "memory": "4Gi"}}},
    },
    "secured": {
        "model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"},
        "engine": {"apiKeySecretRef": {"name": "llm-engine-key"}},
        "router": {"apiKeySecretRef": {"name": "llm-api-key", "key": "token"}},
        "networkPolicy": {"enabled": True, "metricsNamespaces": ["monitoring"]},
    },
    **{
        f"router-{policy}": {
            "model": {"storageUri": "file:///models/m"},
            "router": {"policy": policy, "prefixBlocks": 4, "loadFactor": 2},
        }
        for policy in ROUTER_POLICIES
    },
}


def make_isvc(spec: dict[str, Any], *, name: str = "llm", uid: str | None = UID) -> InferenceService:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "generation": 1}
    if uid:
        meta["uid"] = uid
    return InferenceService.model_validate({"metadata": meta, "spec": copy.deepcopy(spec)})


def by_key(children: list[dict]) -> dict[tuple[str, str], dict]:
    """Children keyed by (kind, name); fails on duplicates."""
    out = {(c["kind"], c["metadata"]["name"]): c for c in children}
    assert len(out) == len(children), "two children share kind and name"
    return out


def get(children: list[dict], kind: str, name: str) -> dict:
    return by_key(children)[(kind, name)]


def container(deployment: dict, name: str) -> dict:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def component_of(child: dict) -> str:
    return child["metadata"]["labels"][constants.LABEL_COMPONENT]


# --- schemas --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_child_validates_strictly(case: str, version: str) -> None:
    children = render_children(make_isvc(SPECS[case]), OPTIONS)
    for child in children:
        try:
            kubernetes_validate.validate(child, version, strict=True)
        except kubernetes_validate.ValidationError as e:  # name the object: the library's message does not
            pytest.fail(f"{child['kind']}/{child['metadata']['name']} invalid for Kubernetes {version}: {e.message}")


def test_validator_is_strict() -> None:
    """The check above can fail: an unknown field in a rendered Deployment is refused."""
    dep = get(render_children(make_isvc(SPECS["demo"]), OPTIONS), "Deployment", constants.engine_deployment_name("llm"))
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbeTypo"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)


def test_kinds_are_declared_child_types() -> None:
    declared = {(t.api_version, t.kind) for t in CHILD_TYPES}
    seen = set()
    for spec in SPECS.values():
        for child in render_children(make_isvc(spec), OPTIONS):
            seen.add((child["apiVersion"], child["kind"]))
    assert seen == declared  # every declared type is produced by some spec, and nothing undeclared
    for t in CHILD_TYPES:
        plural = t.kind.lower()[:-1] + "ies" if t.kind.endswith("y") else t.kind.lower() + "s"
        assert t.namespaced and t.plural == plural


# --- names, labels, owner references --------------------------------------------------------------------------------


def test_names_labels_and_owner_references() -> None:
    name = "llm"
    children = render_children(make_isvc(SPECS["autoscale-queue"], name=name), OPTIONS)
    keys = set(by_key(children))
    router_sa = constants.router_deployment_name(name)
    assert keys == {
        ("ConfigMap", config_map_name(name)),
        ("ServiceAccount", router_sa),
        ("Role", router_sa),
        ("RoleBinding", router_sa),
        ("Service", constants.engine_deployment_name(name)),
        ("Deployment", constants.engine_deployment_name(name)),
        ("Service", constants.router_service_name(name)),
        ("Deployment", constants.router_deployment_name(name)),
        ("PodDisruptionBudget", constants.engine_deployment_name(name)),
        ("HorizontalPodAutoscaler", name),
    }
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == NS
        assert meta["labels"] == child_labels(name, component_of(child))
        assert meta["labels"][constants.LABEL_NAME] == constants.LABEL_NAME_VALUE
        assert meta["labels"][constants.LABEL_INFERENCE_SERVICE] == name
        assert meta["ownerReferences"] == [
            {
                "apiVersion": f"{constants.API_GROUP}/{constants.API_VERSION}",
                "kind": constants.CRD_KIND,
                "name": name,
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    router_side = {
        (c["kind"], c["metadata"]["name"]) for c in children if component_of(c) == constants.COMPONENT_ROUTER
    }
    assert router_side == {
        ("ServiceAccount", router_sa),
        ("Role", router_sa),
        ("RoleBinding", router_sa),
        ("Service", constants.router_service_name(name)),
        ("Deployment", constants.router_deployment_name(name)),
    }


def test_no_owner_reference_without_uid() -> None:
    for child in render_children(make_isvc(SPECS["demo"], uid=None), OPTIONS):
        assert "ownerReferences" not in child["metadata"]


def test_engine_selector_matches_engine_pods_only() -> None:
    name = "llm"
    children = render_children(make_isvc(SPECS["demo"], name=name), OPTIONS)
    engine = get(children, "Deployment", constants.engine_deployment_name(name))
    router = get(children, "Deployment", constants.router_deployment_name(name))
    selector = dict(kv.split("=", 1) for kv in engine_selector(name).split(","))
    assert selector == engine["spec"]["selector"]["matchLabels"]
    engine_pod = engine["spec"]["template"]["metadata"]["labels"]
    router_pod = router["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= engine_pod.items()
    assert not selector.items() <= router_pod.items()
    for svc_name, pod_labels, other in (
        (constants.engine_deployment_name(name), engine_pod, router_pod),
        (constants.router_service_name(name), router_pod, engine_pod),
    ):
        svc_selector = get(children, "Service", svc_name)["spec"]["selector"]
        assert svc_selector.items() <= pod_labels.items() and not svc_selector.items() <= other.items()
    pdb = get(children, "PodDisruptionBudget", constants.engine_deployment_name(name))
    assert pdb["spec"]["selector"]["matchLabels"] == selector


def test_invalid_name_and_unknown_demo_model_raise_value_error() -> None:
    with pytest.raises(ValueError, match="DNS-1035"):
        render_children(make_isvc(SPECS["demo"], name="x" * 60), OPTIONS)
    with pytest.raises(ValueError, match="DNS-1035"):
        render_children(make_isvc(SPECS["demo"], name="Upper"), OPTIONS)
    # The API refuses an unknown demo model; render refuses it too for an object that skipped validation.
    with pytest.raises(ValueError, match="storageUri"):
        make_isvc({"model": {"storageUri": "demo://tinyllama"}})
    isvc = make_isvc(SPECS["demo"])
    isvc.spec.model.storage_uri = "demo://tinyllama"  # pydantic does not validate assignments here
    with pytest.raises(ValueError, match="unknown demo model 'tinyllama'"):
        render_children(isvc, OPTIONS)


# --- the router meets the engines ------------------------------------------------------------------------------------


def endpoint_slice_for(service: dict, pod_ips: list[str], container_port: int) -> dict:
    """An EndpointSlice as the EndpointSlice controller writes it for ``service``: the Service's labels plus
    kubernetes.io/service-name (and the managed-by / headless labels), its ports by name with the resolved target
    port, one ready endpoint per pod."""
    svc_meta = service["metadata"]
    labels = {
        **svc_meta["labels"],
        constants.LABEL_SERVICE_NAME: svc_meta["name"],
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    }
    if service["spec"].get("clusterIP") == "None":
        labels["service.kubernetes.io/headless"] = ""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{svc_meta['name']}-7fz2q",
            "namespace": svc_meta["namespace"],
            "generateName": f"{svc_meta['name']}-",
            "labels": labels,
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "targetRef": {"kind": "Pod", "name": f"pod-{i}", "namespace": svc_meta["namespace"]},
            }
            for i, ip in enumerate(pod_ips)
        ],
        "ports": [
            {"name": p["name"], "port": container_port, "protocol": p["protocol"]} for p in service["spec"]["ports"]
        ],
    }


def parse_cli(argv: list[str]):
    from radixserve.launch.cli import build_parser

    return build_parser().parse_args(argv)


def test_router_discovers_the_engine_service() -> None:
    from radixserve.router.config import router_args_from_namespace
    from radixserve.router.discovery import EndpointSliceDiscovery, _is_selected, endpoints_from_slices

    name = "llm"
    children = render_children(make_isvc(SPECS["demo"], name=name), OPTIONS)
    engine_svc = get(children, "Service", constants.engine_deployment_name(name))
    router_svc = get(children, "Service", constants.router_service_name(name))
    engine = get(children, "Deployment", constants.engine_deployment_name(name))
    router = get(children, "Deployment", constants.router_deployment_name(name))
    assert engine_svc["spec"]["clusterIP"] == "None"

    # The Service's port resolves to the engine container's port of that name.
    (svc_port,) = engine_svc["spec"]["ports"]
    assert svc_port["name"] == constants.HTTP_PORT_NAME and svc_port["port"] == constants.ENGINE_PORT
    ports = {p["name"]: p["containerPort"] for p in container(engine, ENGINE_CONTAINER)["ports"]}
    container_port = ports[svc_port["targetPort"]]
    assert container_port == constants.ENGINE_PORT

    # The router, started with the rendered flags, selects that Service's slices and routes to the pods' http port.
    rc = container(router, ROUTER_CONTAINER)
    ns = parse_cli(rc["args"])
    assert ns.command == "router" and rc["command"] == ["radixserve"]
    args = router_args_from_namespace(ns)
    assert args.service_discovery and args.namespace == NS
    discovery = EndpointSliceDiscovery(args.namespace, args.service_name, port_name=constants.HTTP_PORT_NAME)
    engine_slice = endpoint_slice_for(engine_svc, ["10.244.1.7", "10.244.2.9"], container_port)
    router_slice = endpoint_slice_for(router_svc, ["10.244.1.8"], constants.ROUTER_PORT)
    for sl in (engine_slice, router_slice):
        kubernetes_validate.validate(sl, K8S_VERSIONS[-1], strict=True)
    label_selector = dict(kv.split("=", 1) for kv in discovery.label_selector.split(","))
    assert label_selector.items() <= engine_slice["metadata"]["labels"].items()
    assert _is_selected(engine_slice, args.namespace, args.service_name)
    assert not _is_selected(router_slice, args.namespace, args.service_name)
    # --all-inference-services mode: the engine Service's slices are in, the router Service's are not.
    assert _is_selected(engine_slice, NS, None) and not _is_selected(router_slice, NS, None)
    assert sorted(endpoints_from_slices([engine_slice], discovery.port_name)) == [
        f"http://10.244.1.7:{constants.ENGINE_PORT}",
        f"http://10.244.2.9:{constants.ENGINE_PORT}",
    ]

    # The router Service forwards to the router container's http port; the router listens there.
    (public,) = router_svc["spec"]["ports"]
    assert public["port"] == constants.ROUTER_SERVICE_PORT and public["targetPort"] == constants.HTTP_PORT_NAME
    assert {p["name"]: p["containerPort"] for p in rc["ports"]}[constants.HTTP_PORT_NAME] == args.port
    assert args.port == constants.ROUTER_PORT


def test_router_rbac_allows_exactly_the_discovery_calls() -> None:
    name = "llm"
    children = render_children(make_isvc(SPECS["demo"], name=name), OPTIONS)
    sa = constants.router_deployment_name(name)
    (rule,) = get(children, "Role", sa)["rules"]
    assert rule == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    binding = get(children, "RoleBinding", sa)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NS}]
    pod = get(children, "Deployment", constants.router_deployment_name(name))["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa
    assert get(children, "ServiceAccount", sa)["metadata"]["name"] == sa


@pytest.mark.parametrize("case", sorted(SPECS))
def test_rendered_flags_parse_with_the_engine_and_router_parsers(case: str) -> None:
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.router.config import router_args_from_namespace

    isvc = make_isvc(SPECS[case])
    spec = isvc.spec
    children = render_children(isvc, OPTIONS)
    ec = container(get(children, "Deployment", constants.engine_deployment_name("llm")), ENGINE_CONTAINER)
    e = engine_args_from_namespace(parse_cli(ec["args"]))
    assert ec["command"] == ["radixserve"] and ec["args"][0] == "engine"
    assert (e.host, e.port) == ("0.0.0.0", constants.ENGINE_PORT)
    assert e.served_model_name == spec.served_model_name("llm")
    assert e.dtype == spec.engine.dtype and e.schedule_policy == spec.engine.schedule_policy
    assert e.max_total_tokens == spec.engine.kv_cache_tokens
    assert e.context_length == spec.model.context_length
    assert e.tokenizer_path == spec.model.tokenizer
    rc = container(get(children, "Deployment", constants.router_deployment_name("llm")), ROUTER_CONTAINER)
    r = router_args_from_namespace(parse_cli(rc["args"]))
    assert (r.host, r.port) == ("0.0.0.0", constants.ROUTER_PORT)
    assert r.service_discovery and r.service_name == constants.engine_deployment_name("llm") and r.namespace == NS
    assert (r.policy, r.prefix_blocks, r.load_factor) == (
        spec.router.policy,
        spec.router.prefix_blocks,
        spec.router.load_factor,
    )
    # spec.*.args come last, unchanged.
    assert ec["args"][len(ec["args"]) - len(spec.engine.args) :] == spec.engine.args
    assert rc["args"][len(rc["args"]) - len(spec.router.args) :] == spec.router.args


def test_extra_args_are_appended_and_win() -> None:
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.router.config import router_args_from_namespace

    children = render_children(make_isvc(SPECS["extra-args"]), OPTIONS)
    ec = container(get(children, "Deployment", constants.engine_deployment_name("llm")), ENGINE_CONTAINER)
    rc = container(get(children, "Deployment", constants.router_deployment_name("llm")), ROUTER_CONTAINER)
    assert ec["args"][-3:] == ["--max-running-requests", "32", "--disable-radix-cache"]
    e = engine_args_from_namespace(parse_cli(ec["args"]))
    assert e.max_running_requests == 32 and e.disable_radix_cache and e.schedule_policy == "fcfs"
    r = router_args_from_namespace(parse_cli(rc["args"]))
    assert r.max_retries == 3 and r.log_level == "debug"
    # A user flag repeating a rendered one overrides it (argparse keeps the last).
    override = make_isvc({"model": {"storageUri": "file:///m"}, "router": {"args": ["--prefix-blocks", "2"]}})
    rc2 = container(
        get(render_children(override, OPTIONS), "Deployment", constants.router_deployment_name("llm")), ROUTER_CONTAINER
    )
    assert router_args_from_namespace(parse_cli(rc2["args"])).prefix_blocks == 2


# --- the model: storageUri ------------------------------------------------------------------------------------------


def engine_pod(case: str | dict) -> dict:
    spec = SPECS[case] if isinstance(case, str) else case
    dep = get(render_children(make_isvc(spec), OPTIONS), "Deployment", constants.engine_deployment_name("llm"))
    return dep["spec"]["template"]["spec"]


def engine_flags(pod: dict):
    from radixserve.engine.config import engine_args_from_namespace

    (c,) = [c for c in pod["containers"] if c["name"] == ENGINE_CONTAINER]
    return engine_args_from_namespace(parse_cli(c["args"]))


def test_demo_model_comes_from_the_image() -> None:
    pod = engine_pod("demo")
    e = engine_flags(pod)
    assert e.model_path == constants.DEMO_MODEL_IMAGE_DIR
    assert e.served_model_name == constants.DEMO_MODEL_NAME
    assert e.preferred_sampling_params == constants.DEMO_MODEL_SAMPLING_DEFAULTS
    assert "volumes" not in pod and "initContainers" not in pod


def test_file_model_is_a_path_in_the_image() -> None:
    pod = engine_pod("file")
    e = engine_flags(pod)
    assert e.model_path == "/opt/models/qwen" and e.served_model_name == "llm"
    assert e.preferred_sampling_params is None
    assert "volumes" not in pod and "initContainers" not in pod
    assert pod["containers"][0]["imagePullPolicy"] == "Always"


@pytest.mark.parametrize(
    "case,model_path",
    [
        ("pvc", constants.MODEL_MOUNT_PATH + "/llama/3b"),
        ("pvc-root", constants.MODEL_MOUNT_PATH),
    ],
)
def test_pvc_model_is_mounted_read_only(case: str, model_path: str) -> None:
    pod = engine_pod(case)
    claim = SPECS[case]["model"]["storageUri"].removeprefix("pvc://").split("/")[0]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    (mount,) = pod["containers"][0]["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": constants.MODEL_MOUNT_PATH, "readOnly": True}
    assert engine_flags(pod).model_path == model_path
    assert "initContainers" not in pod


def test_hf_model_is_fetched_by_an_init_container_with_the_token() -> None:
    pod = engine_pod("hf-token")
    (volume,) = pod["volumes"]
    assert volume["emptyDir"] == {}
    (init,) = pod["initContainers"]
    assert init["name"] == MODEL_INIT_CONTAINER and init["image"] == OPTIONS.image
    assert init["command"] == [
        "hf",
        "download",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "--local-dir",
        constants.MODEL_MOUNT_PATH,
        "--revision",
        "main",
    ]
    token = [v for v in init["env"] if v["name"] == "HF_TOKEN"]
    assert token == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN", "optional": False}}}
    ]
    assert {"name": volume["name"], "mountPath": constants.MODEL_MOUNT_PATH} in init["volumeMounts"]
    # Requests for the fetch: cpu and memory, never an accelerator.
    assert init["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "6Gi"}}
    assert init["securityContext"]["runAsUser"] == RUN_AS_USER
    e = engine_flags(pod)
    assert e.model_path == constants.MODEL_MOUNT_PATH and e.context_length == 4096
    assert pod["containers"][0]["volumeMounts"][0]["readOnly"] is True

    pod = engine_pod("hf-no-revision")
    (init,) = pod["initContainers"]
    assert init["command"] == [
        "hf",
        "download",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "--local-dir",
        constants.MODEL_MOUNT_PATH,
    ]
    assert not any(v["name"] == "HF_TOKEN" for v in init["env"])


def test_gpu_resources_and_placement_reach_the_engine_pod_as_given() -> None:
    spec = SPECS["gpu-placement"]
    pod = engine_pod("gpu-placement")
    engine = pod["containers"][0]
    assert engine["image"] == spec["engine"]["image"]
    assert engine["resources"] == spec["engine"]["resources"]  # quantities untouched (1 stays 1, "4000m" stays)
    placement = spec["placement"]
    assert pod["nodeSelector"] == placement["nodeSelector"]
    assert pod["tolerations"] == placement["tolerations"]
    assert pod["affinity"] == placement["affinity"]
    assert pod["priorityClassName"] == placement["priorityClassName"]
    e = engine_flags(pod)
    assert e.dtype == "bfloat16" and e.max_total_tokens == 200000
    # Placement is the engines'; the router pod is placed freely.
    router = get(render_children(make_isvc(spec), OPTIONS), "Deployment", constants.router_deployment_name("llm"))
    router_pod = router["spec"]["template"]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "priorityClassName"} & router_pod.keys()


# --- pod shape ------------------------------------------------------------------------------------------------------


def test_engine_probes_security_and_shutdown() -> None:
    spec = {**SPECS["demo"], "engine": {"startupTimeoutSeconds": 3600}}
    dep = get(render_children(make_isvc(spec), OPTIONS), "Deployment", constants.engine_deployment_name("llm"))
    pod = dep["spec"]["template"]["spec"]
    c = container(dep, ENGINE_CONTAINER)
    assert c["ports"] == [{"name": constants.HTTP_PORT_NAME, "containerPort": constants.ENGINE_PORT, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": constants.ENGINE_HEALTH_PATH, "port": constants.HTTP_PORT_NAME}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] == 10 and startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    # The Deployment is not declared stuck while a pod may still be inside its startup budget.
    assert dep["spec"]["progressDeadlineSeconds"] > 3600
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == RUN_AS_USER
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    # Drain: the pod keeps serving through preStop while it leaves the EndpointSlices, within the grace period.
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert 0 < pre_stop < pod["terminationGracePeriodSeconds"]
    # Rollouts never drop below the serving capacity.
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_router_pod_shape() -> None:
    dep = get(
        render_children(make_isvc(SPECS["extra-args"]), OPTIONS), "Deployment", constants.router_deployment_name("llm")
    )
    c = container(dep, ROUTER_CONTAINER)
    assert dep["spec"]["replicas"] == 2
    assert c["image"] == OPTIONS.image
    assert c["resources"] == SPECS["extra-args"]["router"]["resources"]
    # /live: /health is 503 while no engine is routable, and a probe on it would take every router out of the
    # Service (clients then get refused connections instead of OpenAI-format 503s) or restart it in a loop.
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": constants.ROUTER_LIVE_PATH, "port": constants.HTTP_PORT_NAME}
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == RUN_AS_USER


def test_default_image_pull_policy_from_options() -> None:
    options = RenderOptions(image="radixserve:dev", image_pull_policy="IfNotPresent")
    children = render_children(make_isvc(SPECS["hf-token"]), options)
    engine = get(children, "Deployment", constants.engine_deployment_name("llm"))
    router = get(children, "Deployment", constants.router_deployment_name("llm"))
    for c in (
        engine["spec"]["template"]["spec"]["containers"]
        + engine["spec"]["template"]["spec"]["initContainers"]
        + router["spec"]["template"]["spec"]["containers"]
    ):
        assert c["image"] == "radixserve:dev" and c["imagePullPolicy"] == "IfNotPresent"
    for c in render_children(make_isvc(SPECS["demo"]), OPTIONS):
        if c["kind"] == "Deployment":
            assert "imagePullPolicy" not in c["spec"]["template"]["spec"]["containers"][0]


# --- PDB, HPA, replicas ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["autoscale-queue", "autoscale-tokens"])
def test_hpa_scales_the_inference_service(case: str) -> None:
    spec = SPECS[case]
    children = render_children(make_isvc(spec), OPTIONS)
    hpa = get(children, "HorizontalPodAutoscaler", "llm")
    auto = spec["autoscaling"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": f"{constants.API_GROUP}/{constants.API_VERSION}",
        "kind": constants.CRD_KIND,
        "name": "llm",
    }
    assert hpa["spec"]["minReplicas"] == auto.get("minReplicas", 1)
    assert hpa["spec"]["maxReplicas"] == auto["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == AUTOSCALING_METRIC_NAMES[auto["metric"]]
    assert metric["pods"]["metric"]["name"].startswith(constants.ENGINE_METRIC_PREFIX)
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": str(auto["targetPerPod"])}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == auto.get("scaleDownDelaySeconds", 300)
    # Without spec.replicas the Deployment starts at minReplicas.
    engine = get(children, "Deployment", constants.engine_deployment_name("llm"))
    assert engine["spec"]["replicas"] == auto.get("minReplicas", 1)


def test_optional_children() -> None:
    kinds = lambda case: {c["kind"] for c in render_children(make_isvc(SPECS[case]), OPTIONS)}  # noqa: E731
    assert "HorizontalPodAutoscaler" not in kinds("demo")
    assert "PodDisruptionBudget" in kinds("demo")
    assert "PodDisruptionBudget" not in kinds("pdb-off")
    pdb = get(
        render_children(make_isvc(SPECS["pdb-percent"]), OPTIONS),
        "PodDisruptionBudget",
        constants.engine_deployment_name("llm"),
    )
    assert pdb["spec"]["maxUnavailable"] == "50%"
    pdb = get(
        render_children(make_isvc(SPECS["demo"]), OPTIONS),
        "PodDisruptionBudget",
        constants.engine_deployment_name("llm"),
    )
    assert pdb["spec"]["maxUnavailable"] == 1


def diff(a: list[dict], b: list[dict]) -> set[tuple[str, str]]:
    """(kind, name) of children that differ between two renders (added, removed or changed)."""
    ka, kb = by_key(a), by_key(b)
    return {
        k
        for k in ka.keys() | kb.keys()
        if json.dumps(ka.get(k), sort_keys=True) != json.dumps(kb.get(k), sort_keys=True)
    }


def test_replicas_change_touches_only_the_engine_deployment_replicas() -> None:
    spec = SPECS["gpu-placement"]
    before = render_children(make_isvc(spec), OPTIONS)
    after = render_children(make_isvc({**spec, "replicas": 7}), OPTIONS)
    engine = constants.engine_deployment_name("llm")
    assert diff(before, after) == {("Deployment", engine)}
    old, new = get(before, "Deployment", engine), get(after, "Deployment", engine)
    assert (old["spec"]["replicas"], new["spec"]["replicas"]) == (3, 7)
    new["spec"]["replicas"] = 3
    assert new == old  # nothing else, the pod template (so no rollout) included


def test_router_policy_change_touches_only_router_objects_and_the_config() -> None:
    spec = SPECS["router-prefix_hash"]
    before = render_children(make_isvc(spec), OPTIONS)
    after = render_children(make_isvc({**spec, "router": {**spec["router"], "policy": "least_load"}}), OPTIONS)
    changed = diff(before, after)
    assert changed == {("Deployment", constants.router_deployment_name("llm")), ("ConfigMap", config_map_name("llm"))}
    old = get(before, "Deployment", constants.router_deployment_name("llm"))["spec"]["template"]
    new = get(after, "Deployment", constants.router_deployment_name("llm"))["spec"]["template"]
    assert (
        old["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] != new["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    )
    cm = get(after, "ConfigMap", config_map_name("llm"))
    command = json.loads(cm["data"]["router.json"])["command"]
    assert command[command.index("--policy") + 1] == "least_load"


def test_engine_image_change_rolls_only_the_engines() -> None:
    spec = SPECS["demo"]
    before = render_children(make_isvc(spec), OPTIONS)
    after = render_children(make_isvc({**spec, "engine": {"image": "radixserve:new"}}), OPTIONS)
    assert diff(before, after) == {
        ("Deployment", constants.engine_deployment_name("llm")),
        ("ConfigMap", config_map_name("llm")),
    }
    hash_of = lambda children: get(children, "Deployment", constants.engine_deployment_name("llm"))[  # noqa: E731
        "spec"
    ]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    assert hash_of(before) != hash_of(after)
    cm = get(after, "ConfigMap", config_map_name("llm"))
    assert json.loads(cm["data"]["engine.json"])["image"] == "radixserve:new"


def test_graceful_drain_bounds_follow_the_spec() -> None:
    # Issue 16: preStop sleep, then SIGTERM drains for spec.shutdownTimeoutSeconds; the grace period covers both.
    from radixserve.operator.render import PRESTOP_SLEEP_S, termination_grace_seconds

    for spec, timeout in ((SPECS["demo"], 30), (SPECS["long-drain"], 900)):
        isvc = make_isvc(spec)
        children = render_children(isvc, OPTIONS)
        for component, name, cname in (
            (constants.COMPONENT_ENGINE, constants.engine_deployment_name("llm"), ENGINE_CONTAINER),
            (constants.COMPONENT_ROUTER, constants.router_deployment_name("llm"), ROUTER_CONTAINER),
        ):
            dep = get(children, "Deployment", name)
            pod, c = dep["spec"]["template"]["spec"], container(dep, cname)
            assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}}
            assert {"name": constants.SHUTDOWN_TIMEOUT_ENV, "value": str(timeout)} in c["env"]
            grace = pod["terminationGracePeriodSeconds"]
            assert grace == termination_grace_seconds(isvc, component)
            assert grace >= PRESTOP_SLEEP_S + timeout + 10  # the sleep, the drain, and the process's own stop
    # A new bound rolls both (their grace periods change) and is in the configuration.
    before, after = (
        render_children(make_isvc(SPECS["demo"]), OPTIONS),
        render_children(make_isvc({**SPECS["demo"], "shutdownTimeoutSeconds": 120}), OPTIONS),
    )
    assert diff(before, after) == {
        ("Deployment", constants.engine_deployment_name("llm")),
        ("Deployment", constants.router_deployment_name("llm")),
        ("ConfigMap", config_map_name("llm")),
    }
    cm = get(after, "ConfigMap", config_map_name("llm"))["data"]
    assert json.loads(cm["engine.json"])["shutdownTimeoutSeconds"] == 120
    assert json.loads(cm["router.json"])["shutdownTimeoutSeconds"] == 120


def test_the_router_in_its_pod_drains_for_the_spec_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.router.config import router_args_from_namespace

    dep = get(
        render_children(make_isvc(SPECS["long-drain"]), OPTIONS), "Deployment", constants.router_deployment_name("llm")
    )
    c = container(dep, ROUTER_CONTAINER)
    for var in c["env"]:  # as the kubelet sets them
        monkeypatch.setenv(var["name"], var["value"])
    assert router_args_from_namespace(parse_cli(c["args"])).shutdown_timeout == 900.0


# --- determinism ----------------------------------------------------------------------------------------------------


_RENDER_SCRIPT = """
import json, sys
from radixserve.operator.render import RenderOptions, render_children
from radixserve.operator.spec import InferenceService
isvcs = json.loads(sys.stdin.read())
print(json.dumps([render_children(InferenceService.model_validate(i), RenderOptions(image=%r)) for i in isvcs],
                 sort_keys=True))
"""


def test_output_is_deterministic() -> None:
    isvcs = [make_isvc(spec) for spec in SPECS.values()]
    first = json.dumps([render_children(i, OPTIONS) for i in isvcs], sort_keys=True)
    # A round trip through the wire format (what the operator reads back) renders the same bytes.
    again = [InferenceService.model_validate(json.loads(i.model_dump_json(by_alias=True))) for i in isvcs]
    assert json.dumps([render_children(i, OPTIONS) for i in again], sort_keys=True) == first
    # So does another interpreter with another hash seed (no set/dict-order or id() leaks).
    wire = json.dumps([i.model_dump(by_alias=True, exclude_none=True) for i in isvcs])
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _RENDER_SCRIPT % OPTIONS.image],
        input=wire,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == first


def test_router_probe_path_is_served_by_the_router() -> None:
    """The router Deployment's probes hit a path the router app really serves without an API key, and it answers 200
    while no engine is routable (the router's /health is then 503)."""
    from fastapi.testclient import TestClient

    from radixserve.router.app import create_app
    from radixserve.router.config import RouterArgs

    dep = get(render_children(make_isvc(SPECS["demo"]), OPTIONS), "Deployment", constants.router_deployment_name("llm"))
    c = container(dep, ROUTER_CONTAINER)
    paths = {c[probe]["httpGet"]["path"] for probe in ("readinessProbe", "livenessProbe")}
    app = create_app(RouterArgs(worker_urls=["http://127.0.0.1:1"], api_key="sk-router"))
    with TestClient(app) as client:
        for path in paths:
            assert client.get(path).status_code == 200, path
        assert client.get(constants.ROUTER_HEALTH_PATH).status_code == 503  # nothing routable: why not /health


def test_image_pull_secrets_reach_engine_router_and_init_containers_pods() -> None:
    """A private registry (fresh-user review: ImagePullBackOff for every engine and router pod)."""
    children = render_children(make_isvc(SPECS["pull-secrets"]), OPTIONS)
    for dep_name in (constants.engine_deployment_name("llm"), constants.router_deployment_name("llm")):
        pod = get(children, "Deployment", dep_name)["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror.creds"}]
    plain = render_children(make_isvc(SPECS["demo"]), OPTIONS)
    assert all(
        "imagePullSecrets" not in get(plain, "Deployment", d)["spec"]["template"]["spec"]
        for d in (constants.engine_deployment_name("llm"), constants.router_deployment_name("llm"))
    )


@pytest.mark.parametrize(
    "resources,threads",
    [
        ({"limits": {"cpu": "2"}}, 2),
        ({"limits": {"cpu": "1500m"}}, 1),
        ({"limits": {"cpu": "250m"}}, 1),
        ({"requests": {"cpu": 4}}, 4),
        ({"requests": {"cpu": "8"}, "limits": {"cpu": "3"}}, 3),  # the limit is the quota
        ({"limits": {"cpu": "8", "nvidia.com/gpu": 1}}, None),  # GPU engines: torch threads do not matter
        ({"limits": {"memory": "1Gi"}}, None),
        (None, None),
    ],
)
def test_cpu_engines_get_threads_from_their_cpu_figure(resources, threads) -> None:
    """torch starts a thread per host core; under a 2-CPU quota on a 64-core node that throttles the engine."""
    spec = {"model": {"storageUri": "file:///models/m"}}
    if resources is not None:
        spec["engine"] = {"resources": resources}
    c = container(
        get(render_children(make_isvc(spec), OPTIONS), "Deployment", constants.engine_deployment_name("llm")),
        ENGINE_CONTAINER,
    )
    if threads is None:
        assert "--num-threads" not in c["args"]
    else:
        assert c["args"][c["args"].index("--num-threads") + 1] == str(threads)


def test_headless_service_sends_no_zero_values_the_server_omits() -> None:
    """Regression: publishNotReadyAddresses False is omitted by a real API server (omitempty), so comparing it with
    the live Service patched it on every resync."""
    svc = get(render_children(make_isvc(SPECS["demo"]), OPTIONS), "Service", constants.engine_deployment_name("llm"))
    assert "publishNotReadyAddresses" not in svc["spec"]
