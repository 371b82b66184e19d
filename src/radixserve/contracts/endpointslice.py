"""The one rule for which EndpointSlice endpoints take traffic, shared by the router (discovery) and the operator
(status): both must agree on what "a ready engine" is."""

from __future__ import annotations

from typing import Any


def serving_address(endpoint: dict[str, Any]) -> str | None:
    """The address to send traffic to for one ``endpoints[]`` entry of a discovery.k8s.io/v1 EndpointSlice (a JSON
    dict), or None when it takes none: ``conditions.ready`` false (nil means ready, per the API), ``serving`` false,
    ``terminating`` true (a pod being deleted: its requests in flight go on, it takes no new one), or no address.
    All addresses of one endpoint are fungible; the first is used, as kube-proxy does."""
    conditions = endpoint.get("conditions") or {}
    if conditions.get("ready") is False or conditions.get("serving") is False or conditions.get("terminating") is True:
        return None
    addresses = endpoint.get("addresses") or []
    return str(addresses[0]) if addresses else None
