"""Running the operator: ``radixserve operator [flags]`` -> kopf, with /metrics and /healthz beside it.

kopf logs in by itself (``kopf.login_via_client``: in-cluster service account, else the kubeconfig); the reconciler's
own calls use an official ``kubernetes`` client configured the same way (``radixserve.contracts.kube``). kopf runs
standalone (no peering objects: the chart runs one replica) and watches either the given namespaces or the whole
cluster. kopf stops on SIGTERM/SIGINT (its own signal handlers) after the handlers in flight finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import Any

import radixserve
from radixserve.contracts import constants
from radixserve.contracts.kube import KubeConfigError, kube_api_client

__all__ = [
    "OperatorConfig",
    "DEFAULT_IMAGE",
    "add_operator_args",
    "config_from_namespace",
    "run_operator",
    "main",
]

DEFAULT_IMAGE = f"{constants.IMAGE_REPOSITORY}:{radixserve.__version__}"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True)
class OperatorConfig:
    """The operator's settings (flags of ``radixserve operator``).

    ``namespaces``: watch only these; empty with ``all_namespaces`` True: the whole cluster. ``resync_seconds``: the
    drift-repair timer's interval. ``metrics_port``: /metrics and /healthz (None: not served, for embedding).
    """

    image: str = DEFAULT_IMAGE
    image_pull_policy: str | None = None
    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    resync_seconds: float = 30.0
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = constants.OPERATOR_METRICS_PORT

    def __post_init__(self) -> None:
        if bool(self.namespaces) == self.all_namespaces:
            raise ValueError("give either --namespace NS (one or more) or --all-namespaces")
        if self.resync_seconds <= 0:
            raise ValueError(f"--resync-seconds must be > 0, got {self.resync_seconds}")
        if self.image_pull_policy is not None and self.image_pull_policy not in PULL_POLICIES:
            raise ValueError(f"--image-pull-policy must be one of {', '.join(PULL_POLICIES)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")


def add_operator_args(parser: argparse.ArgumentParser) -> None:
    """The ``radixserve operator`` flags."""
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        metavar="NS",
        dest="namespaces",
        help="watch InferenceServices in this namespace (repeat for several)",
    )
    scope.add_argument(
        "--all-namespaces",
        "-A",
        action="store_true",
        help="watch InferenceServices in every namespace (needs cluster-wide RBAC)",
    )
    parser.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help=f"image for engine and router pods unless the InferenceService names one (default {DEFAULT_IMAGE})",
    )
    parser.add_argument(
        "--image-pull-policy",
        choices=PULL_POLICIES,
        default=None,
        help="pull policy for that image (default: Kubernetes' own)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="interval of the drift-repair timer per InferenceService, seconds (default 30)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=constants.OPERATOR_METRICS_PORT,
        help=f"port of the operator's own /metrics (Prometheus) and /healthz (200 once kopf is "
        f"ready, 503 before; served by radixserve, not kopf's liveness endpoint) "
        f"(default {constants.OPERATOR_METRICS_PORT})",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=("debug", "info", "warning", "error", "critical"),
        help="log level (default info)",
    )


def config_from_namespace(ns: argparse.Namespace) -> OperatorConfig:
    """The OperatorConfig of parsed flags; raises ValueError for values argparse cannot check."""
    return OperatorConfig(
        image=ns.image,
        image_pull_policy=ns.image_pull_policy,
        namespaces=tuple(ns.namespaces or ()),
        all_namespaces=ns.all_namespaces,
        resync_seconds=ns.resync_seconds,
        metrics_port=ns.metrics_port,
    )


async def run_operator(
    config: OperatorConfig,
    *,
    api_client: Any = None,
    stop_flag: Any = None,
    ready_flag: Any = None,
    metrics: Any = None,
) -> None:
    """Run kopf with this operator's handlers until ``stop_flag`` (asyncio.Event/Future) is set or SIGTERM/SIGINT.

    ``api_client``: the reconciler's kubernetes ApiClient (default ``kube_api_client()``); ``ready_flag`` (an
    asyncio or threading Event) is set when kopf has started (it also gates /healthz); ``metrics``: an
    ``OperatorMetrics`` to read the counters (tests).
    """
    # Imported here: `radixserve --help` and the other subcommands need not import kopf.
    import kopf

    from radixserve.operator.apply import KubeApi
    from radixserve.operator.cache_heat import MIN_SAMPLE_INTERVAL_S, CacheHeat
    from radixserve.operator.handlers import QuietHandlerSuccess, Reconciler, build_registry, configure_settings
    from radixserve.operator.metrics import OperatorMetrics, serve
    from radixserve.operator.render import RenderOptions

    client = api_client if api_client is not None else kube_api_client()
    # kopf logs every child watch event's and resync tick's success at INFO: demoted to DEBUG while we run.
    quiet = QuietHandlerSuccess()
    kopf_objects = logging.getLogger("kopf.objects")
    kopf_objects.addFilter(quiet)
    metrics = metrics or OperatorMetrics()
    ready = ready_flag if ready_flag is not None else asyncio.Event()
    # The engines' cache heat is read at most every resync (or 10 s, when resyncs come faster).
    heat = CacheHeat(min_interval_s=min(MIN_SAMPLE_INTERVAL_S, config.resync_seconds))
    reconciler = Reconciler(KubeApi(client), RenderOptions(config.image, config.image_pull_policy), metrics, heat=heat)
    registry = build_registry(reconciler, config.resync_seconds)
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    async with contextlib.AsyncExitStack() as stack:
        if config.metrics_port is not None:
            await stack.enter_async_context(serve(metrics, ready, config.metrics_host, config.metrics_port))
        try:
            await kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                clusterwide=config.all_namespaces,
                namespaces=config.namespaces,
                stop_flag=stop_flag,
                ready_flag=ready,
            )
        finally:
            kopf_objects.removeFilter(quiet)
    if api_client is None:
        client.close()


def main(config: OperatorConfig) -> int:
    """Run the operator in a new event loop until SIGTERM/SIGINT; the exit status: 0, or 2 (one line on stderr) when
    there are no usable Kubernetes credentials."""
    try:
        client = kube_api_client()
    except KubeConfigError as exc:
        print(f"radixserve operator: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("radixserve.operator").info(
        "radixserve operator %s: image %s, watching %s",
        radixserve.__version__,
        config.image,
        "all namespaces" if config.all_namespaces else ", ".join(config.namespaces),
    )
    try:
        asyncio.run(run_operator(config, api_client=client))
    finally:
        client.close()
    return 0
