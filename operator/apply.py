"""Level-based, idempotent apply of desired children with the official ``kubernetes`` client (REST over its ApiClient).

No PUT and no server-side apply (neither works everywhere the operator is tested; see ../shared/K8S_TESTING.md):

- ``apply(api, desired, live)``: no live object -> create (POST); otherwise a three-way JSON merge patch (RFC 7386,
  what ``kubectl apply`` does for custom resources) computed by ``merge_patch_for``: fields of ``desired`` that differ
  from ``live`` (desired is compared as a SUBSET: fields the API server defaults or other controllers add are not
  drift; Kubernetes quantities are compared by value, so ``"1000m"`` equals ``1``), plus ``None`` for fields of the
  last applied manifest (annotation ``LAST_APPLIED_ANNOTATION``) that ``desired`` no longer has. No difference -> no
  request at all.
- ``prune(api, owner_uid, desired, live)``: deletes live children owned by ``owner_uid`` that are no longer desired.
- Every call retries 409 Conflict (create: the object appeared meanwhile -> re-read and patch), 429 and 5xx and
  connection errors with bounded exponential backoff (``RetryPolicy``); what still fails is raised as
  ``kopf.TemporaryError`` so kopf retries the handler later.

Lists are replaced as a whole when they differ (merge-patch semantics); strategic merge is not used because custom
resources do not support it and the emulator treats it as a plain merge.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol

import kopf
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from radixserve import constants

__all__ = [
    "LAST_APPLIED_ANNOTATION",
    "ResourceType",
    "RetryPolicy",
    "KubeApi",
    "ApplyResult",
    "merge_patch_for",
    "quantity",
    "subset_equal",
    "is_owned_by",
    "apply",
    "prune",
]

LAST_APPLIED_ANNOTATION = f"{constants.API_GROUP}/last-applied"
MERGE_PATCH = "application/merge-patch+json"
log = logging.getLogger("radixserve.operator.apply")


class ResourceType(Protocol):
    """What a call needs to know about a kind (``render.ChildType`` is one)."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: ``attempts`` tries, sleeping ``base_delay_s * 2**i`` (at most ``max_delay_s``)
    between them; ``handler_delay_s`` is the delay asked of kopf when all tries failed."""

    attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    handler_delay_s: float = 10.0


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (409, 429) or (exc.status or 0) >= 500
    return isinstance(exc, (Urllib3Error, OSError))


def _describe(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message")
        except (ValueError, AttributeError):
            message = None
        return f"HTTP {exc.status} {exc.reason}: {message or exc.body}"
    return f"{type(exc).__name__}: {exc}"


class KubeApi:
    """Generic JSON REST calls (get, list, create, merge-patch, delete) for any kind, through a configured
    ``kubernetes.client.ApiClient`` (its auth, TLS and connection pool). Raises ``ApiException`` (404 is returned as
    ``None`` by ``get``); ``call`` adds the retries of ``RetryPolicy`` and turns what is left into
    ``kopf.TemporaryError``."""

    def __init__(self, client: ApiClient, retry: RetryPolicy = RetryPolicy()) -> None:
        self.client = client
        self.retry = retry

    @staticmethod
    def path(rtype: ResourceType, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
        """The REST path: ``/api/v1/...`` for the core group, ``/apis/GROUP/VERSION/...`` otherwise."""
        base = "/api/v1" if rtype.api_version == "v1" else f"/apis/{rtype.api_version}"
        if rtype.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{rtype.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base

    def request(self, method: str, path: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json") -> Any:
        """One HTTP call; the decoded JSON answer. Raises ApiException on a non-2xx status."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        req = self.client.param_serialize(method=method, resource_path=path, query_params=query or [],
                                          header_params=headers, body=body, auth_settings=["BearerToken"])
        resp = self.client.call_api(*req, _request_timeout=30)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=resp.data.decode("utf-8", "replace"), data=None)
        return json.loads(resp.data) if resp.data else None

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with retries on 409/429/5xx/connection errors; raises kopf.TemporaryError when
        the tries are spent or the error is not retryable (the message names ``what``)."""
        for attempt in range(self.retry.attempts):
            try:
                return fn(*args, **kwargs)
            except (ApiException, Urllib3Error, OSError) as exc:
                if not _retryable(exc) or attempt == self.retry.attempts - 1:
                    raise kopf.TemporaryError(f"{what}: {_describe(exc)}", delay=self.retry.handler_delay_s) from exc
                delay = min(self.retry.max_delay_s, self.retry.base_delay_s * 2 ** attempt)
                log.info("%s: %s; retrying in %.1f s", what, _describe(exc), delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", self.path(rtype, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, rtype: ResourceType, namespace: str | None, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects whose labels include ``labels``. The selector is sent AND re-checked here (a server that ignores
        it, like the test emulator, still gives the right answer)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        answer = self.request("GET", self.path(rtype, namespace), query=[("labelSelector", selector)])
        items = (answer or {}).get("items") or []
        return [item for item in items
                if all((item.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())]

    def create(self, rtype: ResourceType, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", self.path(rtype, namespace), body=body)

    def merge_patch(self, rtype: ResourceType, namespace: str | None, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        return self.request("PATCH", self.path(rtype, namespace, name, subresource), body=patch,
                            content_type=MERGE_PATCH)

    def delete(self, rtype: ResourceType, namespace: str | None, name: str) -> None:
        """Delete with background propagation (the garbage collector removes what the object owns); a 404 is
        success."""
        try:
            self.request("DELETE", self.path(rtype, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiException as exc:
            if exc.status != 404:
                raise


# --- comparing desired with live --------------------------------------------------------------------------------

_QUANTITY_RE = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")
_SUFFIXES = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"),
    "E": Decimal("1e18"), "Ki": Decimal(2 ** 10), "Mi": Decimal(2 ** 20), "Gi": Decimal(2 ** 30),
    "Ti": Decimal(2 ** 40), "Pi": Decimal(2 ** 50), "Ei": Decimal(2 ** 60),
}
# Keys whose values are quantities the API server canonicalizes ("1000m" -> "1", 0.5 -> "500m"): container and
# quota resources, HPA metric targets, emptyDir sizes.
_QUANTITY_PARENTS = frozenset({"requests", "limits", "hard"})
_QUANTITY_KEYS = frozenset({"averageValue", "sizeLimit"})


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity (``"500m"``, ``"2Gi"``, ``"1e3"``, ``1``) as an exact Decimal; None if it is not one."""
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
    suffix = m.group(2) or ""
    if suffix[:1] in "eE" and suffix:
        return number * Decimal(10) ** int(suffix[1:])
    return number * _SUFFIXES[suffix]


def _is_quantity_path(path: tuple[str, ...]) -> bool:
    return bool(path) and (path[-1] in _QUANTITY_KEYS or (len(path) > 1 and path[-2] in _QUANTITY_PARENTS))


def subset_equal(desired: Any, live: Any, path: tuple[str, ...] = ()) -> bool:
    """True when every field of ``desired`` is in ``live`` with an equal value (dicts recursively; lists element by
    element with equal lengths; quantities by value). Extra fields of ``live`` do not count."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(value is None and key not in live or key in live and subset_equal(value, live[key], (*path, key))
                   for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(subset_equal(d, v, (*path, "[]")) for d, v in zip(desired, live)))
    if desired == live and type(desired) is type(live):
        return True
    if _is_quantity_path(path):
        qd, ql = quantity(desired), quantity(live)
        return qd is not None and qd == ql
    return desired == live and not isinstance(desired, bool) and not isinstance(live, bool)


def _patch_dict(desired: dict, live: dict, last: dict | None, path: tuple[str, ...]) -> dict:
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        if value is None:
            continue
        live_value = live.get(key)
        last_value = last.get(key) if isinstance(last, dict) else None
        if isinstance(value, dict) and isinstance(live_value, dict):
            sub = _patch_dict(value, live_value, last_value if isinstance(last_value, dict) else None, (*path, key))
            if sub:
                patch[key] = sub
        elif isinstance(value, list) and last is not None and last_value is not None and value != last_value:
            patch[key] = value  # changed since the last apply: replace the list (drops removed elements' fields)
        elif key not in live or not subset_equal(value, live_value, (*path, key)):
            patch[key] = value
    if isinstance(last, dict):  # fields we applied before and no longer want
        for key in last:
            if key not in desired and key in live:
                patch[key] = None
    return patch


def merge_patch_for(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that brings ``live`` to ``desired``, or ``{}`` when it already is there (module doc).

    Only ``metadata.labels``, ``metadata.annotations``, ``metadata.ownerReferences`` and the top-level content fields
    (spec, data, rules, subjects, ...) are compared; ``status`` and server-owned metadata never are. The patch carries
    the new last-applied annotation whenever it changes anything.
    """
    last_raw = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED_ANNOTATION)
    try:
        last = json.loads(last_raw) if last_raw else None
    except ValueError:
        last = None
    last = last if isinstance(last, dict) else None
    wanted = _managed_view(desired)
    patch = _patch_dict(wanted, _managed_view(live), _managed_view(last) if last else None, ())
    record = last_applied_record(desired)
    if patch or last_raw != record:
        patch.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED_ANNOTATION] = record
    return patch


_MANAGED_METADATA = ("labels", "annotations", "ownerReferences")


def _managed_view(obj: dict[str, Any]) -> dict[str, Any]:
    """The fields apply manages: content fields and the managed metadata (without the last-applied record)."""
    view = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = obj.get("metadata") or {}
    managed = {k: meta[k] for k in _MANAGED_METADATA if meta.get(k) is not None}
    annotations = {k: v for k, v in (managed.get("annotations") or {}).items() if k != LAST_APPLIED_ANNOTATION}
    if annotations:
        managed["annotations"] = annotations
    else:
        managed.pop("annotations", None)
    if managed:
        view["metadata"] = managed
    return view


def is_owned_by(obj: dict[str, Any], owner_uid: str | None) -> bool:
    """True when ``obj`` has an ownerReference to ``owner_uid`` (always True when the owner's uid is unknown)."""
    if owner_uid is None:
        return True
    return any(ref.get("uid") == owner_uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def _controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


# --- apply and prune --------------------------------------------------------------------------------------------


@dataclass
class ApplyResult:
    """What ``apply`` did: ``action`` is "created", "patched" or "unchanged"; ``obj`` the object as stored now;
    ``patch`` the merge patch sent (None unless patched)."""

    action: str
    obj: dict[str, Any]
    patch: dict[str, Any] | None = None


def apply(api: KubeApi, rtype: ResourceType, desired: dict[str, Any],
          live: dict[str, Any] | None | type[Ellipsis] = ...) -> ApplyResult:
    """Bring one child to ``desired`` (module doc). ``live`` is the object as last read (None: known absent; omitted:
    read it now). Raises kopf.TemporaryError when the API keeps failing, or when an object of that name exists and is
    controlled by another owner (it is never taken over)."""
    meta = desired["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    what = f"{rtype.kind} {namespace}/{name}"
    if live is ...:
        live = api.call(f"get {what}", api.get, rtype, namespace, name)
    owner = _controller_uid(desired)
    for attempt in range(api.retry.attempts):
        try:
            if live is None:
                body = {**desired, "metadata": {**meta, "annotations": {
                    **(meta.get("annotations") or {}), LAST_APPLIED_ANNOTATION: last_applied_record(desired)}}}
                return ApplyResult("created", api.create(rtype, namespace, body))
            live_owner = _controller_uid(live)
            if owner is not None and live_owner != owner:
                raise kopf.TemporaryError(
                    f"{what} exists but is not controlled by this InferenceService (controller uid {live_owner}); "
                    "delete or rename it", delay=api.retry.handler_delay_s * 6)
            patch = merge_patch_for(desired, live)
            if not patch:
                return ApplyResult("unchanged", live)
            # Optimistic concurrency: the patch applies only to the version compared against (else 409, re-read).
            patch.setdefault("metadata", {})["resourceVersion"] = live["metadata"].get("resourceVersion")
            return ApplyResult("patched", api.merge_patch(rtype, namespace, name, patch), patch)
        except (ApiException, Urllib3Error, OSError) as exc:
            # 409 on create: it appeared meanwhile; on patch: it changed meanwhile; 404 on patch: it went away.
            # All three: re-read and try again (no sleep needed for a 409/404, the next read sees the new state).
            conflict = isinstance(exc, ApiException) and exc.status in (404, 409)
            if not (conflict or _retryable(exc)) or attempt == api.retry.attempts - 1:
                raise kopf.TemporaryError(f"apply {what}: {_describe(exc)}", delay=api.retry.handler_delay_s) from exc
            if not conflict:
                delay = min(api.retry.max_delay_s, api.retry.base_delay_s * 2 ** attempt)
                log.info("apply %s: %s; retrying in %.1f s", what, _describe(exc), delay)
                time.sleep(delay)
            live = api.call(f"get {what}", api.get, rtype, namespace, name)
    raise AssertionError("unreachable")


def last_applied_record(desired: dict[str, Any]) -> str:
    """The ``LAST_APPLIED_ANNOTATION`` value for ``desired``: its managed fields as canonical JSON."""
    return json.dumps(_managed_view(desired), sort_keys=True, separators=(",", ":"))


def prune(api: KubeApi, rtype: ResourceType, owner_uid: str | None, desired_names: set[str],
          live: list[dict[str, Any]]) -> list[str]:
    """Delete the objects of ``live`` (children of one kind, already selected by the InferenceService label) that are
    owned by ``owner_uid`` and not in ``desired_names``; returns their names. Objects owned by someone else are
    left alone even when they carry the label."""
    deleted = []
    for obj in live:
        meta = obj.get("metadata") or {}
        if meta.get("name") in desired_names or meta.get("deletionTimestamp") or owner_uid is None:
            continue
        if not is_owned_by(obj, owner_uid):
            continue
        api.call(f"delete {rtype.kind} {meta.get('namespace')}/{meta['name']}", api.delete, rtype,
                 meta.get("namespace"), meta["name"])
        deleted.append(meta["name"])
    return deleted
