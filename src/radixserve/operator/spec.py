"""The InferenceService API (``radixserve.io/v1alpha1``): pydantic models that are the ONE source of truth.

The CRD's ``openAPIV3Schema`` (crds/, charts/radixserve/crds/) is generated from these models by
``radixserve.operator.crd``; a test fails when the YAML drifts from them. The operator parses every object it
reconciles with ``InferenceService.model_validate`` so an object the API server accepted but that is still invalid
(e.g. applied before the CRD was updated) becomes a Degraded condition with the pydantic message, nothing applied.

Field names follow KServe where users know them (``storageUri``, ``minReplicas``/``maxReplicas``, ``status.url``,
``Ready`` condition). Python attributes are snake_case; the wire format is camelCase (pydantic aliases).
Units: token counts in tokens, durations in seconds, ``resources`` in Kubernetes quantities.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from radixserve.contracts import constants

# DNS-1123 subdomain (Secret, PriorityClass names) and label value (nodeSelector values) grammars.
DNS1123_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


_QUANTITY_RE = re.compile(r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(?:[eE]([+-]?[0-9]+)|([KMGTPE]i|[numkMGTPE]))?$")
_SUFFIXES = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


def parse_quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity (``"500m"``, ``"2Gi"``, ``"1e3"``, ``"1E"`` (exa), ``1``) as an exact Decimal; None if it
    is not one. Grammar: k8s.io/apimachinery/pkg/api/resource (decimal SI n u m k M G T P E, binary Ki..Ei, or a
    decimal exponent e/E followed by digits)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    if not isinstance(value, str):
        return None
    m = _QUANTITY_RE.match(value.strip())
    if not m:
        return None
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        return None
    if m.group(2) is not None:
        return number.scaleb(int(m.group(2)))
    return number * _SUFFIXES[m.group(3) or ""]


def _check_quantity(value: int | str) -> int | str:
    if parse_quantity(value) is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 2, 8Gi, 1e9)")
    return value


def _check_int_or_percent(value: int | str) -> int | str:
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{value} must be >= 0")
    if isinstance(value, str) and not re.match(r"^[0-9]+%$", value):
        raise ValueError(f"{value!r} must be a non-negative integer or a percentage like '25%'")
    return value


_INT_OR_STRING = Field(json_schema_extra={"x-kubernetes-int-or-string": True})
# A Kubernetes quantity ("500m", "2Gi", 1) and an int-or-percent ("25%", 1). Checked by the operator (InvalidSpec)
# rather than by a CRD pattern: int-or-string nodes take no pattern in a structural schema.
IntOrString = Annotated[int | str, _INT_OR_STRING]
Quantity = Annotated[int | str, _INT_OR_STRING, AfterValidator(_check_quantity)]
IntOrPercent = Annotated[int | str, _INT_OR_STRING, AfterValidator(_check_int_or_percent)]
Dns1123Name = Annotated[str, Field(pattern=DNS1123_SUBDOMAIN_PATTERN, max_length=253)]
# DNS-1123 label (namespace names) and a Secret's data key (core/v1 validation.IsConfigMapKey).
DNS1123_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
Dns1123Label = Annotated[str, Field(pattern=DNS1123_LABEL_PATTERN, max_length=63)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]

STORAGE_SCHEMES = ("pvc", "hf", "file", "demo")
DEMO_MODELS = (constants.DEMO_MODEL_NAME,)  # demo://NAME: the models an image can bake in
STORAGE_URI_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|hf://[^/\s]+/[^/@\s]+(@[^\s]+)?|file:///.*|demo://("
    + "|".join(m.replace(".", r"\.") for m in DEMO_MODELS)
    + "))$"
)

ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("lpm", "fcfs")
ROUTER_POLICIES = ("prefix_hash", "least_load", "round_robin", "power_of_two")
AUTOSCALING_METRICS = ("queue", "tokensInFlight")

# Engine gauge an HPA averages per pod for each autoscaling metric (served by a Prometheus adapter through the
# custom metrics API under the same name).
AUTOSCALING_METRIC_NAMES = {
    "queue": constants.ENGINE_METRIC_PREFIX + "num_queue_reqs",
    "tokensInFlight": constants.ENGINE_METRIC_PREFIX + "num_used_tokens",
}


class _Model(BaseModel):
    """Base: camelCase on the wire, unknown fields refused (the CRD is structural, so the API server prunes them)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset optional fields omitted."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ModelSpec(_Model):
    """Which model the engines serve and where its weights come from."""

    storage_uri: str = Field(
        json_schema_extra={"pattern": STORAGE_URI_PATTERN},  # in the CRD; here _check_storage_uri says it in words
        description=(
            "Where the weights are: pvc://CLAIM/PATH (mounted read-only), hf://ORG/REPO[@REVISION] (fetched by an "
            "init container), file:///PATH (baked into the image), or demo://smollm2-135m-instruct (the demo model "
            "shipped with radixserve)."
        ),
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[^-\s][^\s]*$",  # no whitespace, no leading '-' (it is a command-line value)
        description="Model name in the OpenAI API (default: the demo model's name, else the InferenceService name).",
    )
    tokenizer: str | None = Field(
        default=None,
        pattern=r"^/",
        description="Tokenizer directory path inside the engine container (default: the model's own).",
    )
    context_length: int | None = Field(
        default=None, ge=16, le=10_000_000, description="Longest prompt + completion in tokens."
    )
    hf_token_secret: Dns1123Name | None = Field(
        default=None,
        description="Name of a Secret whose key HF_TOKEN is given to the hf:// fetch (private or gated repos).",
    )

    @field_validator("storage_uri")
    @classmethod
    def _check_storage_uri(cls, uri: str) -> str:
        if re.match(STORAGE_URI_PATTERN, uri):
            return uri
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        if scheme not in STORAGE_SCHEMES:
            raise ValueError(
                f"storageUri {uri!r}: scheme {scheme + '://' if scheme else '(none)'} is not supported; use one of "
                "pvc://CLAIM[/PATH], hf://ORG/REPO[@REVISION], file:///ABSOLUTE/PATH, "
                + ", ".join(f"demo://{m}" for m in DEMO_MODELS)
            )
        forms = {
            "pvc": "pvc://CLAIM[/PATH] (CLAIM a PersistentVolumeClaim name)",
            "hf": "hf://ORG/REPO[@REVISION]",
            "file": "file:///ABSOLUTE/PATH",
            "demo": " or ".join(f"demo://{m}" for m in DEMO_MODELS),
        }
        raise ValueError(f"storageUri {uri!r} is malformed: expected {forms[scheme]}")

    @property
    def storage_scheme(self) -> str:
        """The URI scheme: one of ``STORAGE_SCHEMES``."""
        return self.storage_uri.split("://", 1)[0]


class ResourceRequirements(_Model):
    """Container resources in Kubernetes quantities, e.g. ``{"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}}``."""

    requests: dict[str, Quantity] | None = None
    limits: dict[str, Quantity] | None = None


# The flags whose value is a key, per component: in spec.*.args they are stored in plain text (the InferenceService,
# the ConfigMap, the pod spec); apiKeySecretRef is the way to pass them.
KEY_FLAGS = {"engine": ("--api-key",), "router": ("--api-key", "--engine-api-key")}


class SecretKeyRef(_Model):
    """One key of a Secret in the InferenceService's namespace (core/v1 SecretKeySelector, never ``optional``: a
    missing Secret holds the pod at CreateContainerConfigError instead of serving without a key)."""

    name: Dns1123Name = Field(description="Secret name, in the InferenceService's namespace.")
    key: str = Field(
        default="api-key",
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Key in the Secret's data holding the API key.",
    )


class EngineSpec(_Model):
    """The engine pods: image, flags and resources."""

    image: str | None = Field(default=None, description="Engine image (default: the operator's --image).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    args: list[str] = Field(default_factory=list, description="Extra `radixserve engine` flags, appended last.")
    resources: ResourceRequirements | None = None
    dtype: Literal[ENGINE_DTYPES] = "auto"  # type: ignore[valid-type]
    kv_cache_tokens: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="KV cache pool size in tokens (engine --max-total-tokens)."
    )
    schedule_policy: Literal[SCHEDULE_POLICIES] = "lpm"  # type: ignore[valid-type]
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "The key engines require (Authorization: Bearer), as env RADIXSERVE_API_KEY; the router calls them with "
            "it (RADIXSERVE_ENGINE_API_KEY). Probes and /metrics stay open."
        ),
    )
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=60,
        le=86400,
        description=(
            "Budget for weight load + warm-up before the pod is restarted (an hf:// download runs before it, in the "
            "init container)."
        ),
    )


class AutoscalingSpec(_Model):
    """An HPA scaling the InferenceService (its scale subresource) on engine saturation, not request counts."""

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(ge=1)
    metric: Literal[AUTOSCALING_METRICS] = Field(  # type: ignore[valid-type]
        default="queue",
        description="queue: requests waiting per pod (num_queue_reqs); tokensInFlight: KV tokens in use per pod.",
    )
    target_per_pod: int = Field(ge=1, description="Target average of the metric per engine pod.")
    scale_down_delay_seconds: int = Field(
        default=300, ge=0, le=3600, description="Stabilization window before scaling down (seconds)."
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})"
            )
        return self


class RouterSpec(_Model):
    """The cache-aware router in front of the engines (one Deployment + Service per InferenceService)."""

    policy: Literal[ROUTER_POLICIES] = "prefix_hash"  # type: ignore[valid-type]
    prefix_blocks: int = Field(default=8, ge=1, le=256, description="Blocks hashed into the routing key (K).")
    load_factor: float = Field(default=1.25, ge=1.0, le=100.0, description="Bounded-load cap x mean tokens in flight.")
    replicas: int = Field(default=1, ge=0)
    image: str | None = Field(default=None, description="Router image (default: the operator's --image).")
    resources: ResourceRequirements | None = None
    args: list[str] = Field(default_factory=list, description="Extra `radixserve router` flags, appended last.")
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "The key clients must send to the router (Authorization: Bearer), as env RADIXSERVE_API_KEY. Probes and "
            "/metrics stay open."
        ),
    )


class Toleration(_Model):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _exists_takes_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(f"toleration operator Exists takes no value (got value {self.value!r})")
        return self


def check_kubernetes_object(value: Any, type_name: str, path: str) -> None:
    """Raise ValueError when ``value`` does not have the shape of Kubernetes type ``type_name`` (e.g. "V1Affinity"):
    an unknown field (a typo the API server would drop with only a warning) or a value of the wrong JSON type.

    Walks the official kubernetes client's generated models (``openapi_types`` / ``attribute_map``), so the check
    follows the client's API version; it does not check required fields or enum values (the API server does)."""
    import kubernetes.client as k8s_models

    if type_name.startswith("List["):
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            check_kubernetes_object(item, type_name[5:-1], f"{path}[{i}]")
        return
    if type_name.startswith("Dict["):
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a map, got {type(value).__name__}")
        for key, item in value.items():
            check_kubernetes_object(item, type_name[5:-1].split(", ", 1)[1], f"{path}.{key}")
        return
    primitives: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if type_name in primitives:
        if not isinstance(value, primitives[type_name]) or (type_name == "int" and isinstance(value, bool)):
            raise ValueError(f"{path}: expected {type_name}, got {value!r}")
        return
    model = getattr(k8s_models, type_name, None)
    if model is None:  # "object" and other free-form types
        return
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected an object ({type_name}), got {value!r}")
    fields = {wire: model.openapi_types[attr] for attr, wire in model.attribute_map.items()}
    for key, item in value.items():
        if key not in fields:
            raise ValueError(f"{path}: unknown field {key!r} (known: {', '.join(sorted(fields))})")
        check_kubernetes_object(item, fields[key], f"{path}.{key}")


class PlacementSpec(_Model):
    """Where engine pods run. ``affinity`` is a core/v1 Affinity, passed through unchanged once its shape is checked
    (the CRD keeps it free-form: a typo would otherwise be dropped by the API server with only a warning)."""

    node_selector: dict[str, LabelValue] | None = None
    tolerations: list[Toleration] | None = None
    affinity: dict[str, Any] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    priority_class_name: Dns1123Name | None = None

    @field_validator("affinity")
    @classmethod
    def _check_affinity(cls, affinity: dict[str, Any] | None) -> dict[str, Any] | None:
        if affinity is not None:
            check_kubernetes_object(affinity, "V1Affinity", "affinity")
        return affinity


class DisruptionBudgetSpec(_Model):
    """The engines' PodDisruptionBudget (on by default: a drain takes at most ``maxUnavailable`` engines at once)."""

    enabled: bool = True
    max_unavailable: IntOrPercent = 1


class NetworkPolicySpec(_Model):
    """A NetworkPolicy ``NAME-engine`` (off by default): engine pods accept connections only from this
    InferenceService's router pods, and from pods in ``metricsNamespaces`` (Prometheus). Layer 4 only: those
    namespaces reach the whole engine port, not just /metrics. Kubelet probes are not affected."""

    enabled: bool = False
    metrics_namespaces: list[Dns1123Label] = Field(
        default_factory=list,
        description="Namespaces (by name) whose pods may also connect to the engines, e.g. [monitoring].",
    )


class InferenceServiceSpec(_Model):
    """``spec`` of an InferenceService. ``replicas`` is what ``kubectl scale`` and an HPA write (scale subresource)."""

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replicas: int | None = Field(
        default=None, ge=0, description="Engine pods (default: autoscaling.minReplicas, else 1)."
    )
    autoscaling: AutoscalingSpec | None = None
    router: RouterSpec = Field(default_factory=RouterSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    disruption_budget: DisruptionBudgetSpec = Field(default_factory=DisruptionBudgetSpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    image_pull_secrets: list[Dns1123Name] | None = Field(
        default=None, description="Secrets (names, in this namespace) for pulling the engine and router images."
    )
    shutdown_timeout_seconds: int = Field(
        default=int(constants.DEFAULT_SHUTDOWN_TIMEOUT_S),
        ge=0,
        le=86400,
        description=(
            "Graceful drain: how long requests in flight may still run when an engine or router pod stops (rolling "
            "update, scale-in, node drain). Both get it as RADIXSERVE_SHUTDOWN_TIMEOUT (their --shutdown-timeout); "
            "their terminationGracePeriodSeconds is the preStop sleep + this + a margin. Set it to your longest "
            "request (seconds)."
        ),
    )

    def desired_replicas(self) -> int:
        """Engine replicas to run: ``replicas`` if set, else ``autoscaling.minReplicas``, else 1."""
        if self.replicas is not None:
            return self.replicas
        return self.autoscaling.min_replicas if self.autoscaling else 1

    def plain_text_keys(self) -> list[str]:
        """Where ``args`` carry an API key flag (``KEY_FLAGS``, as ``--flag V`` or ``--flag=V``): e.g.
        ``["spec.router.args --api-key"]``; such a key is stored in plain text. Empty when there is none."""
        found = []
        for component, args in (("engine", self.engine.args), ("router", self.router.args)):
            for flag in KEY_FLAGS[component]:
                if any(a == flag or a.startswith(flag + "=") for a in args):
                    found.append(f"spec.{component}.args {flag}")
        return found

    def served_model_name(self, isvc_name: str) -> str:
        """The OpenAI model name: spec'd, else the demo model's name for demo://, else the InferenceService name."""
        if self.model.served_model_name:
            return self.model.served_model_name
        if self.model.storage_scheme == "demo":
            return self.model.storage_uri.split("://", 1)[1]
        return isvc_name


ConditionType = Literal["Ready", "Progressing", "Degraded"]
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


class Condition(_Model):
    """A status condition (metav1.Condition shape)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class InferenceServiceStatus(_Model):
    """``status``: written by the operator only (status subresource)."""

    observed_generation: int | None = None
    replicas: int | None = Field(default=None, description="Engine pods that exist (scale subresource).")
    ready_replicas: int | None = None
    selector: str | None = Field(default=None, description="Engine pod label selector (scale subresource).")
    url: str | None = None
    model_name: str | None = Field(default=None, description="The served model name (printer column).")
    conditions: list[Condition] | None = None


class ObjectMeta(_Model):
    """The metadata fields the operator reads; everything else is ignored."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


def format_validation_error(exc: ValidationError) -> str:
    """A one-line, user-facing message: ``spec.autoscaling: Value error, ...; spec.model.storageUri: String should
    match pattern '...' (got 's3://b/m')``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg"))
        value = err.get("input")
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and len(str(value)) <= 200:
            msg += f" (got {value!r})"  # scalars only: a whole sub-object would drown the message
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


class InferenceService(_Model):
    """A whole InferenceService object. ``InferenceService.model_validate(body)`` raises pydantic.ValidationError."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: str = f"{constants.API_GROUP}/{constants.API_VERSION}"
    kind: str = constants.CRD_KIND
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None


_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Longest InferenceService name whose derived names (NAME-router, NAME-engine) stay valid DNS-1035 Service names.
MAX_NAME_LENGTH = 63 - len("-router")


# ISVC "x-engine"'s router Service ("x-engine") would be ISVC "x"'s engine Service.
RESERVED_NAME_SUFFIX = "-" + constants.COMPONENT_ENGINE


def check_name(name: str) -> None:
    """Raise ValueError unless ``name`` gives valid child names that no other InferenceService's children can take
    (DNS-1035 label, <= 56 characters, not ending in ``-engine``)."""
    if not _NAME_RE.match(name) or len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"InferenceService name {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
            "(lowercase letters, digits and '-', starting with a letter), so NAME-engine and NAME-router are valid"
        )
    if name.endswith(RESERVED_NAME_SUFFIX):
        raise ValueError(
            f"InferenceService name {name!r} must not end in {RESERVED_NAME_SUFFIX!r}: its router Service would take "
            f"the name of InferenceService {name[: -len(RESERVED_NAME_SUFFIX)]!r}'s engine Service"
        )
