"""Level-based, idempotent apply of desired children with the official ``kubernetes`` client (REST over its ApiClient).

No PUT and no server-side apply (kmock 0.8, the API server emulator the tests run on, has neither: it serves create,
get, list, merge patch, JSON patch and delete):

- ``apply(api, desired, live)``: no live object -> create (POST); otherwise a three-way JSON merge patch (RFC 7386,
  what ``kubectl apply`` does for custom resources) computed by ``merge_patch_for``: fields of ``desired`` that differ
  from ``live`` (desired is compared as a SUBSET: fields the API server defaults or other controllers add are not
  drift; Kubernetes quantities are compared by value, so ``"1000m"`` equals ``1``), plus ``None`` for fields of the
  last applied manifest (annotation ``LAST_APPLIED_ANNOTATION``) that ``desired`` no longer has. No difference -> no
  request at all.
- Prune: ``plan`` also deletes live children owned by this InferenceService that are no longer desired.
- Two phases, so that a change the API server refuses leaves nothing half-applied: ``plan`` computes every create,
  patch and delete from the live objects (an existing object of a desired name that this InferenceService does not
  control is a conflict: it is never taken over), then ``execute`` sends each change with ``dryRun=All`` (the API
  server validates, runs admission and RBAC, persists nothing) and, only when every dry run passed, for real.
- Errors: a 4xx the API server will answer again (400, 403, 422, ..., and a create meeting a foreign object) raises
  ``ApplyRejected`` at once (no retry: the caller reports it in the status and tries again at its next resync);
  409 Conflict (create: the object appeared meanwhile -> re-read and patch; patch: it changed meanwhile -> re-read)
  and 404 on a patch (it went away -> create) are re-planned from a fresh read; a 404 on a DRY-RUN create is not
  an error (a dry run cannot see objects the same plan's earlier dry runs "created": kube-apiserver answers a
  RoleBinding whose roleRef Role does not exist yet with 404 when the caller lacks the ``bind`` verb; the real
  create, which comes after the Role's, reports a real 404); 429, 5xx and connection errors are
  retried with bounded exponential backoff (``RetryPolicy``), and what still fails is raised as
  ``kopf.TemporaryError`` so kopf retries the handler later.
- Zero values: a real API server omits the zero value of an ``omitempty`` field (false, "", empty list or map) when
  it returns an object, so a desired zero value equals an absent live field (``is_empty``; the number 0 is not
  "empty": ``replicas: 0`` is compared as usual). The cost: a hand edit that removes a desired ``false`` from a
  field whose default is true is not seen as drift.

Lists: a desired list matches when it is an in-order SUBSEQUENCE of the live one (each desired element subset-equal to
a distinct live element, order kept), so elements that admission (Kyverno, Gatekeeper, a service mesh) or the server
adds to a list (a toleration, an imagePullSecret, a sidecar container, an env var) are not drift, and no resync
patches them away only to see them re-added. Except when the desired list differs from the last-applied record (the
user removed or changed an element): then the list is replaced as a whole (merge-patch semantics), which also drops
what admission added (it adds it again). The cost: an element added to a list by hand is not repaired. Strategic
merge is not used because custom resources do not support it and the emulator treats it as a plain merge.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, ParamSpec, Protocol, TypeVar

import kopf
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from radixserve.contracts import constants
from radixserve.operator.spec import parse_quantity as quantity  # noqa: F401 - re-exported

__all__ = [
    "LAST_APPLIED_ANNOTATION",
    "ResourceType",
    "RetryPolicy",
    "KubeApi",
    "ApplyResult",
    "ApplyRejected",
    "Change",
    "plan",
    "execute",
    "is_empty",
    "merge_patch_for",
    "quantity",
    "subset_equal",
    "is_owned_by",
    "apply",
]

LAST_APPLIED_ANNOTATION = f"{constants.API_GROUP}/last-applied"
MERGE_PATCH = "application/merge-patch+json"
DRY_RUN = [("dryRun", "All")]
log = logging.getLogger("radixserve.operator.apply")

_P = ParamSpec("_P")
_T = TypeVar("_T")


class ResourceType(Protocol):
    """What a call needs to know about a kind (``render.ChildType``, a frozen dataclass, is one): read-only."""

    @property
    def api_version(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def plural(self) -> str: ...

    @property
    def namespaced(self) -> bool: ...


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
    def path(
        rtype: ResourceType, namespace: str | None, name: str | None = None, subresource: str | None = None
    ) -> str:
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

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One HTTP call; the decoded JSON answer. Raises ApiException on a non-2xx status."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        req = self.client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.client.call_api(*req, _request_timeout=30)
        data: bytes = resp.read()  # what it also stores as resp.data (unannotated there: inferred None)
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=data.decode("utf-8", "replace"), data=None)
        return json.loads(data) if data else None

    def call(self, what: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """``fn(*args, **kwargs)`` with retries on 409/429/5xx/connection errors; raises kopf.TemporaryError when
        the tries are spent or the error is not retryable (the message names ``what``)."""
        for attempt in range(self.retry.attempts):
            try:
                return fn(*args, **kwargs)
            except (ApiException, Urllib3Error, OSError) as exc:
                if not _retryable(exc) or attempt == self.retry.attempts - 1:
                    raise kopf.TemporaryError(f"{what}: {_describe(exc)}", delay=self.retry.handler_delay_s) from exc
                delay = min(self.retry.max_delay_s, self.retry.base_delay_s * 2**attempt)
                log.info("%s: %s; retrying in %.1f s", what, _describe(exc), delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            obj: dict[str, Any] | None = self.request("GET", self.path(rtype, namespace, name))
            return obj
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
        return [
            item
            for item in items
            if all((item.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    def create(
        self, rtype: ResourceType, namespace: str | None, body: dict[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]:
        """POST; ``dry_run``: ``?dryRun=All`` (validated, admitted and authorised, not persisted)."""
        obj: dict[str, Any] = self.request(
            "POST", self.path(rtype, namespace), body=body, query=DRY_RUN if dry_run else None
        )
        return obj

    def merge_patch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
        *,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """PATCH (JSON merge patch); ``dry_run`` as for ``create``."""
        obj: dict[str, Any] = self.request(
            "PATCH",
            self.path(rtype, namespace, name, subresource),
            body=patch,
            content_type=MERGE_PATCH,
            query=DRY_RUN if dry_run else None,
        )
        return obj

    def delete(self, rtype: ResourceType, namespace: str | None, name: str, *, dry_run: bool = False) -> None:
        """Delete with background propagation (the garbage collector removes what the object owns); a 404 is
        success. ``dry_run`` as for ``create``."""
        try:
            self.request(
                "DELETE",
                self.path(rtype, namespace, name),
                query=DRY_RUN if dry_run else None,
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


# --- comparing desired with live --------------------------------------------------------------------------------

# number, then a decimal exponent (e3, E-2) OR a suffix; "E" alone is the exa suffix, not an exponent.
# Keys whose values are quantities the API server canonicalizes ("1000m" -> "1", 0.5 -> "500m"): container and
# quota resources, HPA metric targets, emptyDir sizes.
_QUANTITY_PARENTS = frozenset({"requests", "limits", "hard"})
_QUANTITY_KEYS = frozenset({"averageValue", "sizeLimit"})


def _is_quantity_path(path: tuple[str, ...]) -> bool:
    return bool(path) and (path[-1] in _QUANTITY_KEYS or (len(path) > 1 and path[-2] in _QUANTITY_PARENTS))


def is_empty(value: Any) -> bool:
    """True for what a real API server leaves out of an object it returns (``omitempty`` zero values): None, False,
    "", and lists/maps that are empty or hold only such values. The number 0 is not empty (``replicas: 0``)."""
    if value is None or value is False or value == "":
        return True
    if isinstance(value, dict):
        return all(is_empty(v) for v in value.values())
    if isinstance(value, list):
        return not value
    return False


def subset_equal(desired: Any, live: Any, path: tuple[str, ...] = ()) -> bool:
    """True when every field of ``desired`` is in ``live`` with an equal value (dicts recursively; a list when it is
    an in-order subsequence of the live list, each element subset-equal to a distinct live element; quantities by
    value). Extra fields and extra list elements of ``live`` do not count, and a desired empty value
    (``is_empty``) equals an absent live field."""
    if isinstance(desired, dict):
        if live is None and is_empty(desired):
            return True
        if not isinstance(live, dict):
            return False
        return all(
            is_empty(value) and live.get(key) is None or key in live and subset_equal(value, live[key], (*path, key))
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        # In-order subsequence: each desired element subset-equal to a distinct live element, order kept (greedy
        # leftmost matching finds an embedding whenever one exists). Elements admission added are not drift.
        remaining = iter(live)
        return all(any(subset_equal(d, v, (*path, "[]")) for v in remaining) for d in desired)
    if desired == live and type(desired) is type(live):
        return True
    if _is_quantity_path(path):
        qd, ql = quantity(desired), quantity(live)
        return qd is not None and qd == ql
    return desired == live and not isinstance(desired, bool) and not isinstance(live, bool)


def _patch_dict(
    desired: dict[str, Any], live: dict[str, Any], last: dict[str, Any] | None, path: tuple[str, ...]
) -> dict[str, Any]:
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
        elif live_value is None and is_empty(value):
            continue  # omitted by the server as a zero value: not drift
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
            uid: str | None = ref.get("uid")
            return uid
    return None


# --- plan, apply and prune --------------------------------------------------------------------------------------


class ApplyRejected(Exception):
    """A child write that retrying will not fix: the API server answered a 4xx other than 404/409/429 (400 bad
    request, 403 forbidden, 422 invalid, ...) or a desired name is taken by an object this InferenceService does not
    control. ``reason``: the status condition reason (``ChildConflict``, ``Forbidden``, ``ApplyRejected``);
    ``http_status``: the HTTP status (409 for a conflict); ``kind``, ``name``: the child; ``str(exc)``: a message for
    the status and the Event (names ``Kind/name`` and carries the API server's own message)."""

    def __init__(self, reason: str, http_status: int, kind: str, name: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.http_status = http_status
        self.kind = kind
        self.name = name


def _rejected(exc: Exception, verb: str, rtype: ResourceType, name: str) -> ApplyRejected:
    """``exc``: an ApiException, or another error that carries an HTTP ``status``."""
    status: int | None = getattr(exc, "status", None)
    reason = "Forbidden" if status == 403 else "ApplyRejected"
    return ApplyRejected(reason, status or 400, rtype.kind, name, f"{verb} {rtype.kind}/{name}: {_describe(exc)}")


def _final_4xx(exc: Exception) -> bool:
    return isinstance(exc, ApiException) and 400 <= (exc.status or 0) < 500 and exc.status not in (404, 409, 429)


def _backoff(api: KubeApi, exc: Exception, what: str, attempt: int) -> None:
    """Sleep before the next try of a retryable failure; raise kopf.TemporaryError when the tries are spent."""
    if attempt >= api.retry.attempts - 1:
        raise kopf.TemporaryError(f"{what}: {_describe(exc)}", delay=api.retry.handler_delay_s) from exc
    delay = min(api.retry.max_delay_s, api.retry.base_delay_s * 2**attempt)
    log.info("%s: %s; retrying in %.1f s", what, _describe(exc), delay)
    time.sleep(delay)


def _check_controller(rtype: ResourceType, desired: dict[str, Any], live: dict[str, Any]) -> None:
    """Raise ApplyRejected(ChildConflict) when ``live`` is not controlled by ``desired``'s controller."""
    owner = _controller_uid(desired)
    live_owner = _controller_uid(live)
    if owner is None or live_owner == owner:
        return
    name = desired["metadata"]["name"]
    who = f"controller uid {live_owner}" if live_owner else "no controller ownerReference"
    raise ApplyRejected(
        "ChildConflict",
        409,
        rtype.kind,
        name,
        f"{rtype.kind}/{name} already exists and is not controlled by this InferenceService "
        f"({who}); it is left alone: delete or rename it",
    )


@dataclass
class ApplyResult:
    """What ``apply`` did: ``action`` is "created", "patched", "unchanged" or "deleted"; ``obj`` the object as stored
    now (as it would be stored, for a dry run); ``patch`` the merge patch sent (None unless patched)."""

    action: str
    obj: dict[str, Any]
    patch: dict[str, Any] | None = None


def apply(
    api: KubeApi,
    rtype: ResourceType,
    desired: dict[str, Any],
    live: dict[str, Any] | None | EllipsisType = ...,
    *,
    dry_run: bool = False,
) -> ApplyResult:
    """Bring one child to ``desired`` (module doc). ``live`` is the object as last read (None: known absent; omitted:
    read it now); ``dry_run``: send the write with ``dryRun=All``. Raises ApplyRejected for a 4xx the server will
    repeat or when an object of that name exists and is controlled by another owner (it is never taken over), and
    kopf.TemporaryError when the API keeps failing (429, 5xx, connection)."""
    meta = desired["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    what = f"{rtype.kind}/{name}"  # the status and Event messages name children so
    if isinstance(live, EllipsisType):  # omitted
        live = api.call(f"get {what}", api.get, rtype, namespace, name)
    for attempt in range(api.retry.attempts):
        verb = "create" if live is None else "patch"
        try:
            if live is None:
                body = {
                    **desired,
                    "metadata": {
                        **meta,
                        "annotations": {
                            **(meta.get("annotations") or {}),
                            LAST_APPLIED_ANNOTATION: last_applied_record(desired),
                        },
                    },
                }
                return ApplyResult("created", api.create(rtype, namespace, body, dry_run=dry_run))
            _check_controller(rtype, desired, live)
            patch = merge_patch_for(desired, live)
            if not patch:
                return ApplyResult("unchanged", live)
            # Optimistic concurrency: the patch applies only to the version compared against (else 409, re-read).
            patch.setdefault("metadata", {})["resourceVersion"] = live["metadata"].get("resourceVersion")
            return ApplyResult("patched", api.merge_patch(rtype, namespace, name, patch, dry_run=dry_run), patch)
        except (ApiException, Urllib3Error, OSError) as exc:
            if dry_run and verb == "create" and getattr(exc, "status", None) == 404:
                # A dry run cannot see what earlier dry runs of the same plan "created": kube-apiserver answers a
                # RoleBinding's create with 404 when its roleRef Role does not exist yet (escalation check, caller
                # without `bind`). Not a reason to refuse the plan: the real phase creates the Role first, and a
                # real 404 (the namespace is gone) is reported there.
                log.debug("dry-run create %s: %s; not known before the real create", what, _describe(exc))
                return ApplyResult("created", body)
            if _final_4xx(exc) or (verb == "create" and getattr(exc, "status", None) == 404):
                raise _rejected(exc, verb, rtype, name) from exc  # 404 on create: the namespace is gone
            # 409 on create: it appeared meanwhile (ours -> patch it; someone else's -> ChildConflict on re-read);
            # on patch: it changed meanwhile; 404 on patch: it went away. All: re-read and plan again, no sleep.
            replan = isinstance(exc, ApiException) and exc.status in (404, 409)
            if replan:
                if attempt == api.retry.attempts - 1:
                    raise kopf.TemporaryError(
                        f"{verb} {what}: {_describe(exc)}", delay=api.retry.handler_delay_s
                    ) from exc
            else:
                _backoff(api, exc, f"{verb} {what}", attempt)
            live = api.call(f"get {what}", api.get, rtype, namespace, name)
    raise AssertionError("unreachable")


def last_applied_record(desired: dict[str, Any]) -> str:
    """The ``LAST_APPLIED_ANNOTATION`` value for ``desired``: its managed fields as canonical JSON."""
    return json.dumps(_managed_view(desired), sort_keys=True, separators=(",", ":"))


def _delete(api: KubeApi, rtype: ResourceType, obj: dict[str, Any], dry_run: bool) -> ApplyResult:
    meta = obj.get("metadata") or {}
    what = f"{rtype.kind}/{meta['name']}"
    for attempt in range(api.retry.attempts):
        try:
            api.delete(rtype, meta.get("namespace"), meta["name"], dry_run=dry_run)
            return ApplyResult("deleted", obj)
        except (ApiException, Urllib3Error, OSError) as exc:
            if _final_4xx(exc) or getattr(exc, "status", None) == 409:
                raise _rejected(exc, "delete", rtype, meta["name"]) from exc
            _backoff(api, exc, f"delete {what}", attempt)
    raise AssertionError("unreachable")


@dataclass
class Change:
    """One planned step for one child: ``action`` "create", "patch", "delete" or "unchanged"; ``desired`` (None for
    a delete) and ``live`` (None for a create) as planned."""

    rtype: ResourceType
    action: str
    name: str
    desired: dict[str, Any] | None
    live: dict[str, Any] | None


def plan(
    rtype: ResourceType, desired: list[dict[str, Any]], live: list[dict[str, Any]], owner_uid: str | None
) -> list[Change]:
    """The changes that bring the children of one kind from ``live`` (listed by the InferenceService label) to
    ``desired``: create what is absent, patch what differs, keep what matches, delete what ``owner_uid`` owns and no
    longer desires (objects owned by someone else are left alone even when they carry the label). No API call.
    Raises ApplyRejected(ChildConflict) when a desired name is taken by an object this owner does not control."""
    by_name = {o["metadata"]["name"]: o for o in live}
    changes = []
    for child in desired:
        name = child["metadata"]["name"]
        current = by_name.get(name)
        if current is None:
            changes.append(Change(rtype, "create", name, child, None))
            continue
        _check_controller(rtype, child, current)
        action = "patch" if merge_patch_for(child, current) else "unchanged"
        changes.append(Change(rtype, action, name, child, current))
    wanted = {c["metadata"]["name"] for c in desired}
    for obj in live:
        meta = obj.get("metadata") or {}
        if (
            meta.get("name") in wanted
            or meta.get("deletionTimestamp")
            or owner_uid is None
            or not is_owned_by(obj, owner_uid)
        ):
            continue
        changes.append(Change(rtype, "delete", meta["name"], None, obj))
    return changes


def execute(api: KubeApi, changes: list[Change], *, dry_run: bool, on_result: Any = None) -> list[ApplyResult]:
    """Send ``changes`` in order (``dry_run``: each with ``dryRun=All``; nothing persists). ``on_result(change,
    result)`` is called after each (e.g. to post an Event as each child is created). Raises ApplyRejected or
    kopf.TemporaryError (``apply``) at the first change that fails; the ones before it were sent."""
    results = []
    for change in changes:
        if change.action == "unchanged":
            result = ApplyResult("unchanged", change.live or {})
        elif change.action == "delete":
            result = _delete(api, change.rtype, change.live or {}, dry_run)
        else:
            result = apply(api, change.rtype, change.desired or {}, change.live, dry_run=dry_run)
        results.append(result)
        if on_result is not None:
            on_result(change, result)
    return results
