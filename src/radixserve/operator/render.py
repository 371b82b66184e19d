"""Desired children of an InferenceService: a pure function from the spec to Kubernetes manifests (JSON dicts).

No API calls, no clock, no randomness: the same InferenceService renders byte-identical JSON (``json.dumps(...,
sort_keys=True)``), so the handlers can compare desired with live objects and repair drift without churn. The layout
follows docs/architecture.md (and kopf's examples: render plain data, apply it in one call):

- Deployment ``NAME-engine``: ``radixserve engine`` on port ``http`` (ENGINE_PORT), startup/readiness/liveness probes
  on ``/health`` (startup budget ``engine.startupTimeoutSeconds``), non-root (uid 1000), no privilege escalation, all
  capabilities dropped, seccomp RuntimeDefault; the model from ``storageUri`` (pvc://, hf://, file://, demo://);
  placement fields on the pod spec; replicas = ``spec.desired_replicas()`` (what the scale subresource / an HPA write).
- Service ``NAME-engine``: headless (clusterIP None); its EndpointSlices (labelled ``kubernetes.io/service-name``
  plus the Service's own labels by the EndpointSlice controller) are what the router discovers.
- ServiceAccount / Role / RoleBinding ``NAME-router``: get/list/watch EndpointSlices in the namespace, nothing else.
- Deployment ``NAME-router`` and Service ``NAME`` (port ROUTER_SERVICE_PORT -> ``http``): the public endpoint; probes
  on ``/live`` (the process serves), since ``/health`` is 503 while no engine is routable.
- Graceful drain, engine and router pods alike: a preStop sleep of ``PRESTOP_SLEEP_S``, then SIGTERM drains for up to
  ``spec.shutdownTimeoutSeconds`` (env ``RADIXSERVE_SHUTDOWN_TIMEOUT``); ``terminationGracePeriodSeconds`` covers
  both plus the process's own stop (``termination_grace_seconds``).
- API keys (``apiKeySecretRef``) only as env vars read from the Secret (``secretKeyRef``): engines
  ``RADIXSERVE_API_KEY``; the router ``RADIXSERVE_API_KEY`` (its clients' key) and ``RADIXSERVE_ENGINE_API_KEY`` (the
  engines'). Never in args, the ConfigMap or status: no key value is ever rendered.
- NetworkPolicy ``NAME-engine`` when ``networkPolicy.enabled``: ingress to the engine pods' port only from this
  InferenceService's router pods and from ``networkPolicy.metricsNamespaces``.
- ConfigMap ``NAME-config``: the effective engine and router configuration as JSON; a hash of each part is a pod
  template annotation of that component, so a configuration change rolls exactly the pods it concerns.
- PodDisruptionBudget ``NAME-engine`` (policy/v1) when ``disruptionBudget.enabled``.
- HorizontalPodAutoscaler ``NAME`` (autoscaling/v2) when ``spec.autoscaling``: it scales the InferenceService itself
  (scale subresource), and the operator copies ``spec.replicas`` to the Deployment, so the two never fight.

Quantities (resources, maxUnavailable) are rendered exactly as given in the spec.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from radixserve.contracts import constants
from radixserve.operator.spec import (
    AUTOSCALING_METRIC_NAMES,
    DEMO_MODELS,
    InferenceService,
    ResourceRequirements,
    SecretKeyRef,
    check_name,
    parse_quantity,
)

__all__ = [
    "RenderOptions",
    "ChildType",
    "CHILD_TYPES",
    "CONFIG_HASH_ANNOTATION",
    "RUN_AS_USER",
    "ENGINE_CONTAINER",
    "ROUTER_CONTAINER",
    "MODEL_INIT_CONTAINER",
    "child_labels",
    "engine_selector",
    "config_map_name",
    "engine_args",
    "router_args",
    "cpu_threads",
    "termination_grace_seconds",
    "render_children",
    "API_KEY_ENV",
    "ENGINE_API_KEY_ENV",
]

OWNER_API_VERSION = f"{constants.API_GROUP}/{constants.API_VERSION}"
CONFIG_HASH_ANNOTATION = f"{constants.API_GROUP}/config-hash"
RUN_AS_USER = 1000  # the image's non-root user
ENGINE_CONTAINER = "engine"
ROUTER_CONTAINER = "router"
MODEL_INIT_CONTAINER = "fetch-model"
MODEL_VOLUME = "model"
LISTEN_HOST = "0.0.0.0"
HF_TOKEN_KEY = "HF_TOKEN"  # key in spec.model.hfTokenSecret, and the env var huggingface_hub reads
HF_HOME = "/tmp/hf-home"  # the hf CLI's cache and lock files (not the model: that goes to --local-dir)
# The env vars `radixserve engine` / `router` read their keys from (defaults of --api-key, --engine-api-key).
API_KEY_ENV = "RADIXSERVE_API_KEY"
ENGINE_API_KEY_ENV = "RADIXSERVE_ENGINE_API_KEY"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (1.21+)

# Graceful drain (docs/contracts.md, "Graceful drain"; docs/kubernetes.md): a pod leaves the EndpointSlices (its
# endpoint turns terminating) as soon as it is deleted, but routers and kube-proxy learn it a moment later; the preStop
# sleep keeps the container serving as before until they have. Then SIGTERM starts its drain: readiness fails, no new
# request is admitted, those in flight finish for up to spec.shutdownTimeoutSeconds (RADIXSERVE_SHUTDOWN_TIMEOUT, the
# containers' --shutdown-timeout), the rest end with OpenAI-format errors. terminationGracePeriodSeconds = the sleep +
# that timeout + the margin for the process's own shutdown (the engine stops its scheduler; uvicorn closes).
PRESTOP_SLEEP_S = 5
ENGINE_STOP_MARGIN_S = 15
ROUTER_STOP_MARGIN_S = 10
# A Deployment rollout is "stuck" (ProgressDeadlineExceeded) only after the engine's whole startup budget plus this.
PROGRESS_DEADLINE_MARGIN_S = 300
STARTUP_PROBE_PERIOD_S = 10

_INIT_RESOURCE_NAMES = ("cpu", "memory", "ephemeral-storage")  # the fetch needs no accelerator


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide rendering settings (from the operator's flags / Helm values).

    ``image``: default image when ``spec.engine.image`` / ``spec.router.image`` is unset.
    ``image_pull_policy``: default pull policy (None: Kubernetes' own default).
    """

    image: str
    image_pull_policy: str | None = None


@dataclass(frozen=True)
class ChildType:
    """A kind the operator creates: what the handlers list (by label) and prune."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True


CHILD_TYPES: tuple[ChildType, ...] = (
    ChildType("v1", "ConfigMap", "configmaps"),
    ChildType("v1", "ServiceAccount", "serviceaccounts"),
    ChildType("rbac.authorization.k8s.io/v1", "Role", "roles"),
    ChildType("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    ChildType("v1", "Service", "services"),
    ChildType("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    ChildType("apps/v1", "Deployment", "deployments"),
    ChildType("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildType("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
)


def child_labels(isvc_name: str, component: str) -> dict[str, str]:
    """Labels of every child of InferenceService ``isvc_name`` for ``component`` (COMPONENT_ENGINE / _ROUTER); the
    engine's are also its pod selector."""
    return {
        constants.LABEL_NAME: constants.LABEL_NAME_VALUE,
        constants.LABEL_COMPONENT: component,
        constants.LABEL_INFERENCE_SERVICE: isvc_name,
    }


def engine_selector(isvc_name: str) -> str:
    """The engine pods' label selector as ``k=v,k=v`` (keys sorted): ``status.selector`` for the scale subresource."""
    labels = child_labels(isvc_name, constants.COMPONENT_ENGINE)
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))


def config_map_name(isvc_name: str) -> str:
    """Name of the ConfigMap holding the effective configuration."""
    return f"{isvc_name}-config"


# --- helpers --------------------------------------------------------------------------------------------------------


def _meta(isvc: InferenceService, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": isvc.metadata.namespace,
        "labels": child_labels(isvc.metadata.name, component),
    }
    if isvc.metadata.uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": OWNER_API_VERSION,
                "kind": constants.CRD_KIND,
                "name": isvc.metadata.name,
                "uid": isvc.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def _resources(res: ResourceRequirements | None, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """core/v1 ResourceRequirements; quantities as given. ``names`` keeps only those resources."""
    if res is None:
        return {}
    out: dict[str, Any] = {}
    for part in ("requests", "limits"):
        values = getattr(res, part)
        if values:
            kept = {k: v for k, v in sorted(values.items()) if names is None or k in names}
            if kept:
                out[part] = kept
    return out


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,  # the model volume (PVC / emptyDir) is readable/writable by the engine user
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _http_probe(path: str, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": constants.HTTP_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def _config_hash(part: dict[str, Any]) -> str:
    """First 16 hex digits of the SHA-256 of ``part`` as canonical JSON."""
    return hashlib.sha256(_canonical_json(part).encode()).hexdigest()[:16]


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _secret_env(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    """Env var ``name`` from the Secret key ``ref``. Not optional: a missing Secret or key holds the pod at
    CreateContainerConfigError (named in its events) rather than starting it without the key."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": False}}}


def _key_env(isvc: InferenceService, component: str) -> dict[str, Any]:
    """``{"env": [...]}`` with the API keys of ``component`` (COMPONENT_ENGINE / _ROUTER), or ``{}`` without any."""
    engine_ref, router_ref = isvc.spec.engine.api_key_secret_ref, isvc.spec.router.api_key_secret_ref
    env = []
    if component == constants.COMPONENT_ENGINE:
        if engine_ref:
            env.append(_secret_env(API_KEY_ENV, engine_ref))
    else:
        if router_ref:
            env.append(_secret_env(API_KEY_ENV, router_ref))
        if engine_ref:
            env.append(_secret_env(ENGINE_API_KEY_ENV, engine_ref))
    return {"env": env} if env else {}


def _drain_env(isvc: InferenceService) -> dict[str, Any]:
    """The env var that bounds a container's graceful drain: ``RADIXSERVE_SHUTDOWN_TIMEOUT`` (seconds), the default
    of the engine's and the router's ``--shutdown-timeout`` (a flag in ``args`` still wins)."""
    return {"name": constants.SHUTDOWN_TIMEOUT_ENV, "value": str(isvc.spec.shutdown_timeout_seconds)}


def _env(isvc: InferenceService, component: str) -> dict[str, Any]:
    """``{"env": [...]}`` of ``component``'s container: its API keys from their Secrets, and the drain bound."""
    return {"env": [*_key_env(isvc, component).get("env", []), _drain_env(isvc)]}


def _pre_stop() -> dict[str, Any]:
    """The preStop hook: a sleep while the pod's terminating endpoint reaches routers and kube-proxy (the container
    serves as before meanwhile), then the kubelet sends SIGTERM."""
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}}


def termination_grace_seconds(isvc: InferenceService, component: str) -> int:
    """``terminationGracePeriodSeconds`` of ``component``'s pods (COMPONENT_ENGINE / _ROUTER): the preStop sleep, the
    drain (``spec.shutdownTimeoutSeconds``) and the process's own shutdown after it, in seconds."""
    margin = ENGINE_STOP_MARGIN_S if component == constants.COMPONENT_ENGINE else ROUTER_STOP_MARGIN_S
    return PRESTOP_SLEEP_S + isvc.spec.shutdown_timeout_seconds + margin


def _image_pull_policy(explicit: str | None, options: RenderOptions) -> dict[str, Any]:
    policy = explicit or options.image_pull_policy
    return {"imagePullPolicy": policy} if policy else {}


# --- the model: storageUri ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelSource:
    """Where the engine finds the model, and what the pod needs for it."""

    model_path: str
    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()
    init_containers: tuple[dict[str, Any], ...] = ()


def _model_source(isvc: InferenceService, image: str, options: RenderOptions) -> _ModelSource:
    """pvc://CLAIM/PATH -> the claim read-only at MODEL_MOUNT_PATH; hf://ORG/REPO[@REV] -> an emptyDir there filled by
    an init container running huggingface_hub's ``hf download``; file:///PATH -> /PATH in the image; demo://NAME ->
    DEMO_MODEL_IMAGE_DIR (baked into the image). Raises ValueError for an unknown demo model."""
    model = isvc.spec.model
    scheme, rest = model.storage_uri.split("://", 1)
    mount_path = constants.MODEL_MOUNT_PATH
    if scheme == "pvc":
        claim, _, sub_path = rest.partition("/")
        sub_path = sub_path.strip("/")
        return _ModelSource(
            model_path=f"{mount_path}/{sub_path}" if sub_path else mount_path,
            volumes=({"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},),
            mounts=({"name": MODEL_VOLUME, "mountPath": mount_path, "readOnly": True},),
        )
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        command = ["hf", "download", repo, "--local-dir", mount_path]
        if revision:
            command += ["--revision", revision]
        env: list[dict[str, Any]] = [
            {"name": "HF_HOME", "value": HF_HOME},
            {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        ]
        if model.hf_token_secret:
            # Not optional: a Secret the user named but that is missing shows as CreateContainerConfigError on the
            # pod, clearer than a 401 from the Hub halfway through a download.
            env.append(
                {
                    "name": HF_TOKEN_KEY,
                    "valueFrom": {
                        "secretKeyRef": {"name": model.hf_token_secret, "key": HF_TOKEN_KEY, "optional": False}
                    },
                }
            )
        init = {
            "name": MODEL_INIT_CONTAINER,
            "image": image,
            **_image_pull_policy(isvc.spec.engine.image_pull_policy, options),
            "command": command,
            "env": env,
            "resources": _resources(isvc.spec.engine.resources, _INIT_RESOURCE_NAMES),
            "securityContext": _container_security_context(),
            "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": mount_path}],
        }
        return _ModelSource(
            model_path=mount_path,
            volumes=({"name": MODEL_VOLUME, "emptyDir": {}},),
            mounts=({"name": MODEL_VOLUME, "mountPath": mount_path, "readOnly": True},),
            init_containers=(init,),
        )
    if scheme == "file":
        return _ModelSource(model_path="/" + rest.lstrip("/"))
    if scheme == "demo":
        if rest not in DEMO_MODELS:
            raise ValueError(
                f"spec.model.storageUri {model.storage_uri!r}: unknown demo model {rest!r} "
                f"(available: {', '.join(DEMO_MODELS)})"
            )
        return _ModelSource(model_path=constants.DEMO_MODEL_IMAGE_DIR)
    raise ValueError(f"spec.model.storageUri {model.storage_uri!r}: unsupported scheme {scheme!r}")


# --- command lines --------------------------------------------------------------------------------------------------


def _image_pull_secrets(isvc: InferenceService) -> dict[str, Any]:
    names = isvc.spec.image_pull_secrets or []
    return {"imagePullSecrets": [{"name": n} for n in names]} if names else {}


def cpu_threads(resources: ResourceRequirements | None) -> int | None:
    """torch threads for a CPU engine: the whole CPUs of its CPU limit (else request), at least 1; None for a GPU
    engine (any ``*gpu*`` resource), without a CPU figure, or with one this does not parse.

    torch starts a thread per host core by default, which under a smaller CFS quota gets the engine throttled.
    """
    if resources is None:
        return None
    sections = [resources.limits or {}, resources.requests or {}]
    if any("gpu" in key for section in sections for key in section):
        return None
    for section in sections:
        if "cpu" in section:
            cpus = parse_quantity(section["cpu"])
            return None if cpus is None else max(1, math.floor(cpus))
    return None


def engine_args(isvc: InferenceService, model_path: str) -> list[str]:
    """``radixserve engine`` flags (after the subcommand) for ``isvc``; ``spec.engine.args`` last, so they win."""
    spec = isvc.spec
    args = [
        "--host",
        LISTEN_HOST,
        "--port",
        str(constants.ENGINE_PORT),
        "--model-path",
        model_path,
        "--served-model-name",
        spec.served_model_name(isvc.metadata.name),
    ]
    if spec.model.tokenizer:
        args += ["--tokenizer-path", spec.model.tokenizer]
    if spec.model.context_length is not None:
        args += ["--context-length", str(spec.model.context_length)]
    args += ["--dtype", spec.engine.dtype, "--schedule-policy", spec.engine.schedule_policy]
    if spec.engine.kv_cache_tokens is not None:
        args += ["--max-total-tokens", str(spec.engine.kv_cache_tokens)]
    threads = cpu_threads(spec.engine.resources)
    if threads is not None:
        args += ["--num-threads", str(threads)]
    if spec.model.storage_scheme == "demo":
        # The 4-bit 135M demo model rambles at temperature 1 (constants.DEMO_MODEL_SAMPLING_DEFAULTS), as in `up`.
        args += ["--preferred-sampling-params", constants.DEMO_MODEL_SAMPLING_DEFAULTS]
    return args + list(spec.engine.args)


def router_args(isvc: InferenceService) -> list[str]:
    """``radixserve router`` flags (after the subcommand) for ``isvc``; ``spec.router.args`` last, so they win."""
    router = isvc.spec.router
    return [
        "--host",
        LISTEN_HOST,
        "--port",
        str(constants.ROUTER_PORT),
        "--service-discovery",
        "--service-name",
        constants.engine_deployment_name(isvc.metadata.name),
        "--namespace",
        str(isvc.metadata.namespace),
        "--policy",
        router.policy,
        "--prefix-blocks",
        str(router.prefix_blocks),
        "--load-factor",
        repr(float(router.load_factor)),
    ] + list(router.args)


# --- children -------------------------------------------------------------------------------------------------------


def _engine_config(isvc: InferenceService, options: RenderOptions) -> dict[str, Any]:
    spec = isvc.spec
    image = spec.engine.image or options.image
    source = _model_source(isvc, image, options)
    return {
        "image": image,
        "storageUri": spec.model.storage_uri,
        "servedModelName": spec.served_model_name(isvc.metadata.name),
        "command": ["radixserve", "engine", *engine_args(isvc, source.model_path)],
        "resources": _resources(spec.engine.resources),
        "startupTimeoutSeconds": spec.engine.startup_timeout_seconds,
        "shutdownTimeoutSeconds": spec.shutdown_timeout_seconds,
    }


def _router_config(isvc: InferenceService, options: RenderOptions) -> dict[str, Any]:
    router = isvc.spec.router
    return {
        "image": router.image or options.image,
        "command": ["radixserve", "router", *router_args(isvc)],
        "resources": _resources(router.resources),
        "shutdownTimeoutSeconds": isvc.spec.shutdown_timeout_seconds,
    }


def _config_map(isvc: InferenceService, engine_cfg: dict[str, Any], router_cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(isvc, config_map_name(isvc.metadata.name), constants.COMPONENT_ENGINE),
        "data": {
            "engine.json": json.dumps(engine_cfg, sort_keys=True, indent=2),
            "router.json": json.dumps(router_cfg, sort_keys=True, indent=2),
        },
    }


def _engine_deployment(isvc: InferenceService, options: RenderOptions, engine_cfg: dict[str, Any]) -> dict[str, Any]:
    spec = isvc.spec
    name = isvc.metadata.name
    labels = child_labels(name, constants.COMPONENT_ENGINE)
    image = engine_cfg["image"]
    source = _model_source(isvc, image, options)
    startup = spec.engine.startup_timeout_seconds
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        **_image_pull_policy(spec.engine.image_pull_policy, options),
        "command": ["radixserve"],
        "args": ["engine", *engine_args(isvc, source.model_path)],
        **_env(isvc, constants.COMPONENT_ENGINE),
        "ports": [{"name": constants.HTTP_PORT_NAME, "containerPort": constants.ENGINE_PORT, "protocol": "TCP"}],
        "resources": _resources(spec.engine.resources),
        "startupProbe": _http_probe(
            constants.ENGINE_HEALTH_PATH,
            period=STARTUP_PROBE_PERIOD_S,
            timeout=5,
            failures=max(1, math.ceil(startup / STARTUP_PROBE_PERIOD_S)),
        ),
        "readinessProbe": _http_probe(constants.ENGINE_HEALTH_PATH, period=5, timeout=5, failures=3),
        "livenessProbe": _http_probe(constants.ENGINE_HEALTH_PATH, period=15, timeout=10, failures=4),
        "lifecycle": _pre_stop(),
        "securityContext": _container_security_context(),
    }
    if source.mounts:
        container["volumeMounts"] = list(source.mounts)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the engine never calls the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_seconds(isvc, constants.COMPONENT_ENGINE),
        "containers": [container],
    }
    if source.init_containers:
        pod_spec["initContainers"] = list(source.init_containers)
    if source.volumes:
        pod_spec["volumes"] = list(source.volumes)
    placement = spec.placement
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(placement.node_selector.items()))
    if placement.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in placement.tolerations]
    if placement.affinity:
        pod_spec["affinity"] = placement.affinity
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    pod_spec.update(_image_pull_secrets(isvc))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(isvc, constants.engine_deployment_name(name), constants.COMPONENT_ENGINE),
        "spec": {
            "replicas": spec.desired_replicas(),
            "selector": {"matchLabels": labels},
            # Never below the serving capacity during a rollout; a new pod must pass its startup probe first.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": startup + PROGRESS_DEADLINE_MARGIN_S,
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {CONFIG_HASH_ANNOTATION: _config_hash(engine_cfg)},
                },
                "spec": pod_spec,
            },
        },
    }


def _engine_service(isvc: InferenceService) -> dict[str, Any]:
    name = isvc.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, constants.engine_deployment_name(name), constants.COMPONENT_ENGINE),
        "spec": {
            "clusterIP": "None",  # headless: the router balances itself, from the EndpointSlices
            "selector": child_labels(name, constants.COMPONENT_ENGINE),
            "ports": [
                {
                    "name": constants.HTTP_PORT_NAME,
                    "port": constants.ENGINE_PORT,
                    "targetPort": constants.HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def _router_rbac(isvc: InferenceService) -> list[dict[str, Any]]:
    name = constants.router_deployment_name(isvc.metadata.name)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(isvc, name, constants.COMPONENT_ROUTER),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(isvc, name, constants.COMPONENT_ROUTER),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(isvc, name, constants.COMPONENT_ROUTER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.metadata.namespace}],
        },
    ]


def _router_deployment(isvc: InferenceService, options: RenderOptions, router_cfg: dict[str, Any]) -> dict[str, Any]:
    router = isvc.spec.router
    name = isvc.metadata.name
    labels = child_labels(name, constants.COMPONENT_ROUTER)
    container = {
        "name": ROUTER_CONTAINER,
        "image": router_cfg["image"],
        **_image_pull_policy(None, options),
        "command": ["radixserve"],
        "args": ["router", *router_args(isvc)],
        **_env(isvc, constants.COMPONENT_ROUTER),
        "ports": [{"name": constants.HTTP_PORT_NAME, "containerPort": constants.ROUTER_PORT, "protocol": "TCP"}],
        "resources": _resources(router.resources),
        # /live, not /health or /ready (both 503 while no engine is routable): clients always reach a router and get
        # OpenAI-format 503s rather than refused connections, and a router is restarted only when it stops serving.
        "readinessProbe": _http_probe(constants.ROUTER_LIVE_PATH, period=5, timeout=5, failures=3),
        "livenessProbe": _http_probe(constants.ROUTER_LIVE_PATH, period=15, timeout=10, failures=4),
        "lifecycle": _pre_stop(),
        "securityContext": _container_security_context(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(isvc, constants.router_deployment_name(name), constants.COMPONENT_ROUTER),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {CONFIG_HASH_ANNOTATION: _config_hash(router_cfg)},
                },
                "spec": {
                    "serviceAccountName": constants.router_deployment_name(name),
                    **_image_pull_secrets(isvc),
                    "enableServiceLinks": False,
                    "securityContext": _pod_security_context(),
                    "terminationGracePeriodSeconds": termination_grace_seconds(isvc, constants.COMPONENT_ROUTER),
                    "containers": [container],
                },
            },
        },
    }


def _router_service(isvc: InferenceService) -> dict[str, Any]:
    name = isvc.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, constants.router_service_name(name), constants.COMPONENT_ROUTER),
        "spec": {
            "type": "ClusterIP",
            "selector": child_labels(name, constants.COMPONENT_ROUTER),
            "ports": [
                {
                    "name": constants.HTTP_PORT_NAME,
                    "port": constants.ROUTER_SERVICE_PORT,
                    "targetPort": constants.HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def _network_policy(isvc: InferenceService) -> dict[str, Any]:
    """Ingress to the engine pods' one port (ENGINE_PORT, ``http``) only from this InferenceService's router pods, from
    the radixserve operator's pods in any namespace (labels ``app.kubernetes.io/name=radixserve``,
    ``app.kubernetes.io/component=operator``: it reads the engines' ``/metrics`` for cache-aware scale-in), plus from
    any pod in ``networkPolicy.metricsNamespaces`` (Prometheus); the policy's podSelector makes every other ingress
    denied. Egress is left open (hf:// downloads). Kubelet probes come from the node, which NetworkPolicies always
    allow."""
    name = isvc.metadata.name
    port = [{"protocol": "TCP", "port": constants.ENGINE_PORT}]
    operator = {
        constants.LABEL_NAME: constants.LABEL_NAME_VALUE,
        constants.LABEL_COMPONENT: constants.COMPONENT_OPERATOR,
    }
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": child_labels(name, constants.COMPONENT_ROUTER)}}], "ports": port},
        {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": operator}}], "ports": port},
    ]
    namespaces = isvc.spec.network_policy.metrics_namespaces
    if namespaces:
        selector = {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": list(namespaces)}]}
        ingress.append({"from": [{"namespaceSelector": selector}], "ports": port})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isvc, constants.engine_deployment_name(name), constants.COMPONENT_ENGINE),
        "spec": {
            "podSelector": {"matchLabels": child_labels(name, constants.COMPONENT_ENGINE)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _pdb(isvc: InferenceService) -> dict[str, Any]:
    name = isvc.metadata.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, constants.engine_deployment_name(name), constants.COMPONENT_ENGINE),
        "spec": {
            "maxUnavailable": isvc.spec.disruption_budget.max_unavailable,
            "selector": {"matchLabels": child_labels(name, constants.COMPONENT_ENGINE)},
            # A pod still loading its model (not ready) must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _hpa(isvc: InferenceService) -> dict[str, Any]:
    name = isvc.metadata.name
    autoscaling = isvc.spec.autoscaling
    assert autoscaling is not None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(isvc, name, constants.COMPONENT_ENGINE),
        "spec": {
            "scaleTargetRef": {"apiVersion": OWNER_API_VERSION, "kind": constants.CRD_KIND, "name": name},
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": AUTOSCALING_METRIC_NAMES[autoscaling.metric]},
                        # A quantity: the API server returns it as a string, so render it as one (no drift).
                        "target": {"type": "AverageValue", "averageValue": str(autoscaling.target_per_pod)},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": autoscaling.scale_down_delay_seconds}},
        },
    }


def render_children(isvc: InferenceService, options: RenderOptions) -> list[dict[str, Any]]:
    """Every desired child of ``isvc`` as a JSON-ready dict, in a fixed order (config and RBAC first, then the
    engine Service, NetworkPolicy and Deployment, the router's Service and Deployment, PDB, HPA). Each has apiVersion,
    kind, metadata (name, namespace, labels; ownerReferences to ``isvc`` when its uid is known). Kinds are among
    ``CHILD_TYPES``; the NetworkPolicy, PDB and HPA only when enabled.

    Raises ValueError with a user-facing message when the spec cannot be rendered: invalid name (``check_name``),
    no namespace, unknown demo model.
    """
    check_name(isvc.metadata.name)
    if not isvc.metadata.namespace:
        raise ValueError(f"InferenceService {isvc.metadata.name!r} has no namespace")
    engine_cfg = _engine_config(isvc, options)
    router_cfg = _router_config(isvc, options)
    children = [
        _config_map(isvc, engine_cfg, router_cfg),
        *_router_rbac(isvc),
        _engine_service(isvc),
        # Before the engines: on create, they never run without it (the handlers apply in CHILD_TYPES order too).
        *([_network_policy(isvc)] if isvc.spec.network_policy.enabled else []),
        _engine_deployment(isvc, options, engine_cfg),
        _router_service(isvc),
        _router_deployment(isvc, options, router_cfg),
    ]
    if isvc.spec.disruption_budget.enabled:
        children.append(_pdb(isvc))
    if isvc.spec.autoscaling is not None:
        children.append(_hpa(isvc))
    return children
