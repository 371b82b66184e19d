"""The Kubernetes API client every wing that talks to the API server uses (the router's EndpointSlice discovery, the
operator's reconciler), and the one error for "no credentials"."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - the kubernetes package is imported lazily (slow, and not needed by engines)
    import kubernetes


class KubeConfigError(RuntimeError):
    """No usable Kubernetes credentials: not in a pod (service account), and the kubeconfig is missing or unusable.
    The message is one line naming the file and where its path came from."""


def kube_api_client() -> kubernetes.client.ApiClient:
    """An ApiClient from the in-cluster service account when running in a pod, else from the kubeconfig
    (``$KUBECONFIG`` or ``~/.kube/config``), as kopf's own login does. Each call gets its own ``Configuration``:
    the client's global default is left alone.

    Raises KubeConfigError when neither works.
    """
    import kubernetes
    import yaml

    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException as incluster:
        # The client reads $KUBECONFIG into this global at import time (a ':'-separated list of files).
        location = os.path.expanduser(kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION)
        source = "from $KUBECONFIG" if os.environ.get("KUBECONFIG") else "the default; $KUBECONFIG is not set"
        cluster = (
            "not running in a pod ($KUBERNETES_SERVICE_HOST/_PORT unset)"
            if not os.environ.get("KUBERNETES_SERVICE_HOST")
            else f"the in-cluster service account failed ({str(incluster).rstrip('.')})"
        )
        where = f"{cluster} and the kubeconfig {location} ({source})"
        if not any(os.path.exists(p) for p in location.split(os.pathsep) if p):
            raise KubeConfigError(f"no Kubernetes credentials: {where} does not exist") from None
        try:
            kubernetes.config.load_kube_config(client_configuration=configuration)
        except (
            kubernetes.config.ConfigException,
            yaml.YAMLError,
            OSError,
            TypeError,
            AttributeError,
            KeyError,
            ValueError,
        ) as exc:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise KubeConfigError(f"no Kubernetes credentials: {where} cannot be used: {detail}") from None
    return kubernetes.client.ApiClient(configuration=configuration)
