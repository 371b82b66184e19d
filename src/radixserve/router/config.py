"""Router configuration: one dataclass with defaults that run on a laptop; flags are its fields in ``--kebab-case``.

Times are in seconds, sizes in bytes, token counts in tokens. ``RouterArgs.validate()`` raises ``RouterConfigError``
(a ``ValueError``) naming the flag at fault. The two keys default from the environment (``API_KEY_ENV``,
``ENGINE_API_KEY_ENV``), so they need not be on a command line, and ``--help`` never shows their values.
``--shutdown-timeout`` defaults to ``$RADIXSERVE_SHUTDOWN_TIMEOUT`` when it is set, as the engine's does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from radixserve.contracts import constants

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UPSTREAM_TRANSPORTS = ("aiohttp", "httpx")
# Environment variables behind --api-key (the key clients send; the engine's flag reads the same one) and
# --engine-api-key (the key sent to the engines). A flag given on the command line wins; an empty value is no key.
API_KEY_ENV = "RADIXSERVE_API_KEY"
ENGINE_API_KEY_ENV = "RADIXSERVE_ENGINE_API_KEY"
_SECRET_ENV = {"api_key": API_KEY_ENV, "engine_api_key": ENGINE_API_KEY_ENV}


class RouterConfigError(ValueError):
    """An invalid router setting; the message names the flag."""


@dataclass
class RouterArgs:
    """Router server arguments.

    Workers come from ``worker_urls`` (static; each engine's models read from its ``/v1/models``) or, with
    ``service_discovery``, from the EndpointSlices of ``service_name`` in ``namespace`` (or of every Service labelled
    ``radixserve.io/inference-service`` with ``all_inference_services``).
    """

    host: str = constants.PUBLIC_HOST
    port: int = constants.ROUTER_PORT
    worker_urls: list[str] = field(default_factory=list)
    service_discovery: bool = False
    namespace: str | None = None  # default: the pod's own namespace, else "default"
    service_name: str | None = None
    all_inference_services: bool = False
    policy: str = "prefix_hash"
    block_tokens: int = 16  # tokens per prefix block (with the model's tokenizer)
    block_chars: int = 64  # characters per prefix block (without it)
    prefix_blocks: int = 8  # K: the routing key hashes the first K blocks
    load_factor: float = 1.25  # bounded-load cap: a worker may take up to load_factor x the mean load
    upstream_transport: str = "aiohttp"  # aiohttp (faster pool under the httpx API) | httpx
    balance_abs_tokens: int = 2048  # ...once it carries this many more tokens in flight than the least loaded one
    cache_threshold: float = 0.5  # a predicted match is cache affinity from this fraction of the prompt's blocks on
    hot_prefix_half_life_s: float = 10.0  # hot-prefix replication: demand half-life; 0 = off
    cache_events_interval_s: float = 0.5  # poll each engine's cache events and load this often; 0 = off
    cache_parity_interval_s: float = 60.0  # re-check each engine's block-hash parity this often; 0 = at admission only
    virtual_nodes: int = 256  # ring points per worker
    default_max_tokens: int = 256  # cost estimate of a request that sets no max tokens
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 600.0  # the longest wait for the next byte from an engine
    engine_stall_timeout_s: float = 30.0  # the longest a request waits on an engine that stopped answering its probes
    max_retries: int = 2  # extra attempts on connect errors / drops / stalls / 503 before the first byte
    health_interval_s: float = 5.0
    pending_probe_interval_s: float = 0.5  # probe a worker not admitted yet (still loading) this often
    eject_after_failures: int = 3
    readmit_after_s: float = 10.0
    api_key: str | None = None  # clients must send "Authorization: Bearer <api_key>"
    engine_api_key: str | None = None  # sent to the engines (their --api-key)
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 2048  # pooled connections to the engines, all together
    discovery_relist_s: float = 30.0
    discovery_stale_s: float = 90.0
    # Graceful drain: seconds requests in flight may still run after SIGTERM / Ctrl-C (default: $SHUTDOWN_TIMEOUT_ENV)
    shutdown_timeout: float = constants.DEFAULT_SHUTDOWN_TIMEOUT_S
    log_level: str = "info"

    def validate(self) -> None:
        """Check the settings and normalise worker URLs (no trailing slash). Raises ``RouterConfigError``."""
        if self.worker_urls and self.service_discovery:
            raise RouterConfigError("give either --worker-urls or --service-discovery, not both")
        urls = []
        for url in self.worker_urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) < 10:
                raise RouterConfigError(f"--worker-urls: {url!r} is not an http:// or https:// URL")
            url = url.rstrip("/")
            if url not in urls:
                urls.append(url)
        self.worker_urls = urls
        if self.service_discovery and not self.all_inference_services and not self.service_name:
            raise RouterConfigError("--service-discovery needs --service-name or --all-inference-services")
        if not 0 <= self.port < 65536:
            raise RouterConfigError(f"--port {self.port} is not a TCP port")
        for name in (
            "block_tokens",
            "block_chars",
            "prefix_blocks",
            "virtual_nodes",
            "default_max_tokens",
            "eject_after_failures",
            "max_request_body_bytes",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise RouterConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in (
            "connect_timeout_s",
            "request_timeout_s",
            "engine_stall_timeout_s",
            "health_interval_s",
            "pending_probe_interval_s",
            "discovery_relist_s",
            "discovery_stale_s",
        ):
            if not getattr(self, name) > 0:
                raise RouterConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise RouterConfigError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.readmit_after_s < 0:
            raise RouterConfigError(f"--readmit-after-s must be >= 0, got {self.readmit_after_s}")
        if self.max_retries < 0:
            raise RouterConfigError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.upstream_transport not in UPSTREAM_TRANSPORTS:
            raise RouterConfigError(f"--upstream-transport must be aiohttp or httpx, got {self.upstream_transport!r}")
        if self.balance_abs_tokens < 0:
            raise RouterConfigError(f"--balance-abs-tokens must be >= 0, got {self.balance_abs_tokens}")
        if self.hot_prefix_half_life_s < 0:
            raise RouterConfigError(f"--hot-prefix-half-life-s must be >= 0, got {self.hot_prefix_half_life_s}")
        for name in ("cache_events_interval_s", "cache_parity_interval_s"):
            if not getattr(self, name) >= 0:
                raise RouterConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise RouterConfigError(f"--cache-threshold must be between 0 and 1, got {self.cache_threshold}")
        if not self.load_factor >= 1.0:
            raise RouterConfigError(f"--load-factor must be at least 1.0, got {self.load_factor}")
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise RouterConfigError(f"--log-level {self.log_level!r} is not a log level")
        try:
            from radixserve.router.policy import POLICIES
        except ImportError:  # the policy package is not there: nothing to check against
            return
        if self.policy not in POLICIES:
            raise RouterConfigError(f"--policy {self.policy!r} is not one of {', '.join(sorted(POLICIES))}")


# One line of ``--help`` per RouterArgs field (argparse appends the default where there is one); a test checks every
# field has one.
HELP: dict[str, str] = {
    "host": "address to listen on",
    "port": "port to listen on",
    "worker_urls": "engine base URLs, e.g. http://127.0.0.1:30000 http://127.0.0.1:30001",
    "service_discovery": "find the engines from Kubernetes EndpointSlices instead of --worker-urls",
    "namespace": "namespace of --service-name (default: the pod's own namespace, else 'default')",
    "service_name": "with --service-discovery: the engines' Service",
    "all_inference_services": "with --service-discovery: every Service labelled radixserve.io/inference-service",
    "policy": "routing policy",
    "block_tokens": "tokens per prefix block (with the model's tokenizer)",
    "block_chars": "characters per prefix block (without a tokenizer)",
    "prefix_blocks": "the routing key hashes the first K prefix blocks",
    "load_factor": "bounded load: a worker may take up to this times the mean load",
    "upstream_transport": "HTTP client to the engines",
    "balance_abs_tokens": "bounded load: a worker is over the cap only once it also carries this many more tokens in "
    "flight than the least loaded one",
    "cache_threshold": "prefix_hash: an engine predicted to hold at least this fraction of a prompt's prefix blocks "
    "gets it for its cache (cache-affinity); below, the prompt goes to its key's owner on the ring (cold), as "
    "sgl-router's --cache-threshold; 0 = any match",
    "hot_prefix_half_life_s": "prefix_hash: seconds for a prefix group's demand to halve; a group with more than one "
    "engine's fair share of the demand is replicated on the next engines of its ring walk (0 = never replicate)",
    "cache_events_interval_s": "seconds between polls of each engine's cache events and load (GET /cache_events, "
    "/load): engines whose block hashes match the router's are routed on what they hold (0 = off: predict only)",
    "cache_parity_interval_s": "seconds between checks that an engine hashes prompts as the router does (POST "
    "/prefix_blocks; 0 = at admission and engine restarts only)",
    "virtual_nodes": "hash-ring points per worker",
    "default_max_tokens": "cost estimate (tokens) of a request that sets no max tokens",
    "connect_timeout_s": "seconds to connect to an engine",
    "request_timeout_s": "longest wait in seconds for the next byte from an engine",
    "engine_stall_timeout_s": "longest time in seconds a request waits on an engine whose health probes fail or time "
    "out (frozen, hung): a request that has sent the client no byte yet is then retried on the next engine, a stream "
    "under way ends with an error event and [DONE]; an engine that answers its probes is never cut off",
    "max_retries": "extra attempts on connect errors, dropped connections, stalled engines, 503 before the first byte",
    "health_interval_s": "seconds between health probes of each worker",
    "pending_probe_interval_s": "seconds between probes of a worker not admitted yet (still loading)",
    "eject_after_failures": "consecutive failures that eject a worker",
    "readmit_after_s": "seconds before an ejected worker is probed for readmission",
    "api_key": f"require 'Authorization: Bearer KEY' from clients (default: ${API_KEY_ENV}, else none)",
    "engine_api_key": f"API key sent to the engines, their --api-key (default: ${ENGINE_API_KEY_ENV}, else none)",
    "max_request_body_bytes": "largest request body in bytes; larger ones are answered 413",
    "max_connections": "pooled connections to the engines, all together",
    "discovery_relist_s": "seconds between full relists of the EndpointSlices",
    "discovery_stale_s": "seconds without a discovery update before the worker list counts as stale",
    "shutdown_timeout": "graceful drain: on SIGTERM / Ctrl-C /health and /ready fail and new requests get 503 at once, "
    "while requests in flight (streams too) may finish for up to this many seconds; the rest then end with a 503 or "
    f"an SSE error event (a second Ctrl-C: at once) (default: %(default)s; ${constants.SHUTDOWN_TIMEOUT_ENV} when "
    "set)",
    "log_level": "log level (case-insensitive)",
}


def _choices(name: str) -> tuple[str, ...] | None:
    """The closed value set of a flag, or None."""
    if name == "log_level":
        return LOG_LEVELS
    if name == "upstream_transport":
        return UPSTREAM_TRANSPORTS
    if name == "policy":
        try:
            from radixserve.router.policy import POLICIES
        except ImportError:  # the policy package is not there: validate() skips the check too
            return None
        return tuple(POLICIES)
    return None


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``RouterArgs`` field as a ``--kebab-case`` flag with its ``HELP`` line (``--worker-urls`` takes one
    or more URLs; ``--policy``, ``--upstream-transport`` and ``--log-level`` list their choices). ``--api-key`` and
    ``--engine-api-key`` default to ``$RADIXSERVE_API_KEY`` / ``$RADIXSERVE_ENGINE_API_KEY``, read when the parser
    is built."""
    for f in dataclasses.fields(RouterArgs):
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        typ = str(f.type)
        help_text = HELP[f.name]
        if f.name in _SECRET_ENV:  # a secret: never "(default: %(default)s)", which would print it
            parser.add_argument(flag, type=str, default=os.environ.get(_SECRET_ENV[f.name]) or None, help=help_text)
            continue
        if f.name == "worker_urls":
            parser.add_argument(flag, nargs="+", default=default, metavar="URL", help=help_text)
            continue
        if f.name == "shutdown_timeout":  # a string default is converted by type=float: a bad value is a usage error
            env = os.environ.get(constants.SHUTDOWN_TIMEOUT_ENV) or None
            parser.add_argument(flag, type=float, default=default if env is None else env, help=help_text)
            continue
        if typ == "bool":
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
            continue
        if default is not None:
            help_text += " (default: %(default)s)"
        if typ.startswith("float"):
            parser.add_argument(flag, type=float, default=default, help=help_text)
        elif typ.startswith("int"):
            parser.add_argument(flag, type=int, default=default, help=help_text)
        else:
            kind = str.lower if f.name == "log_level" else str
            parser.add_argument(flag, type=kind, default=default, choices=_choices(f.name), help=help_text)


def router_args_from_namespace(ns: argparse.Namespace) -> RouterArgs:
    """Build and validate ``RouterArgs`` from parsed flags. Raises ``RouterConfigError``."""
    args = RouterArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RouterArgs)})
    if not args.worker_urls and not args.service_discovery:
        raise RouterConfigError("give the engines: --worker-urls URL [URL ...] or --service-discovery")
    args.validate()
    return args
