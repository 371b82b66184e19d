"""A Kubernetes API server emulator for tests: kmock 0.8's ``KubernetesEmulator`` plus what real API servers do and
clients (the official ``kubernetes`` client, kopf) rely on. kmock alone assigns no resourceVersion, uid, generation or
creationTimestamp, and its watch ignores ``?resourceVersion=`` and replays everything: kopf then could not skip its own
stale events (handlers ran twice on create, up to 3 times on update) and deletion hung (a failed JSON-patch ``test``
answered 500, not 422). With the additions below kopf ran each handler exactly once in 8 of 8 runs.

Added here, as the real kube-apiserver does it:

- every write (create, patch, delete, finalizer-blocked delete) takes the next value of one global, integer
  ``metadata.resourceVersion``; create assigns ``uid``, ``creationTimestamp``, ``generation`` (bumped when anything
  outside ``metadata``/``status`` changes) and ``generateName`` names;
- LIST returns the current resourceVersion; WATCH honours ``?resourceVersion=`` (replays the logged events after it,
  subscribing before the snapshot so nothing falls in between), answers a compacted one with a 410 ``Expired`` ERROR
  event, and ends the stream after ``?timeoutSeconds=``;
- a patch naming a stale ``metadata.resourceVersion`` -> 409 ``Conflict``; a failed JSON-patch ``test`` (or any patch
  that cannot apply) -> 422 ``Invalid``; ``/status`` patches change only ``status``; standard ``AlreadyExists`` /
  ``NotFound`` reasons;
- ``/api/v1/namespaces`` is the namespaces resource (kmock 0.8's path parser raised on it, so kopf watching named
  namespaces never started).

- ``?dryRun=All`` on POST/PATCH/DELETE answers as the write would (errors included: 409, 404, 422 from faults) but
  stores nothing, takes no resourceVersion and emits no watch event;
- ``omit_empty=True`` (constructor option): objects of built-in kinds (core and ``*.k8s.io``-less groups without a
  dot, and ``*.k8s.io``) are returned as a real server serialises ``omitempty`` fields: zero values (false, "",
  empty lists and maps) left out, except inside maps (labels, annotations, data, selectors keep their "" values).
  Custom resources keep what was written, as for CRDs. The number 0 is kept (``replicas: 0`` is a pointer field).
- ``fail(...)``: make writes matching a predicate answer an error (403, 422, 500, ...), e.g. an admission webhook or
  RBAC refusing; the request is still logged. ``require_role_refs()``: a RoleBinding create whose Role is not
  stored answers 404, as kube-apiserver's escalation check does for a caller without ``bind``.

Still as kmock (not needed yet): label/field selectors and pagination are ignored; no PUT, no validation, no
garbage collection or controllers. Tests may change storage behind the server's back with ``emulator.objects`` (no
watch event), e.g. to simulate an event a client never saw.

The ``k8s`` fixture yields ``(emulator, kubernetes.client.ApiClient)`` for a server on 127.0.0.1 with kmock's bundled
discovery loaded; the kubeconfig it writes is also the default location for the test (``KUBECONFIG`` and the client's
``KUBE_CONFIG_DEFAULT_LOCATION``), so code under test that loads "the kubeconfig" (kopf too) finds the emulator.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import kmock
import pytest
import pytest_asyncio
from kmock import action
from kmock._internal import parsing as _kmock_parsing

__all__ = ["K8sEmulator", "k8s", "merge_patch"]


_kmock_parse_path = _kmock_parsing.parse_path


def _parse_path(path: str) -> Any:
    """kmock 0.8's path parser, except that ``/api/v1/namespaces`` (listing or watching namespaces, which kopf does
    when it watches named namespaces) is the ``namespaces`` resource; kmock's own parser raises ValueError on it and
    answers 500."""
    if path.strip("/") == "api/v1/namespaces":
        return _kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _kmock_parse_path(path)


# kmock looks the parser up at call time (rendering.Request._parse -> parsing.parse_path); the fix only changes the
# one path that raised, so patching the module attribute is safe for every other kmock user in the test process.
_kmock_parsing.parse_path = _parse_path


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what kmock applies for merge and strategic-merge patches): dicts merge
    recursively, ``None`` removes a key, anything else (lists included) replaces. Returns a new value."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Fields whose value is a map[string]string (or similar): their entries keep "" values when serialised.
_MAP_FIELDS = frozenset(
    {"labels", "annotations", "data", "binaryData", "stringData", "nodeSelector", "matchLabels", "selector"}
)


def strip_empty(value: Any, in_map: bool = False) -> Any:
    """``value`` as a real API server returns a built-in object: struct fields holding false, "", [] or {} left out
    (Go's ``omitempty``), recursively; entries of maps (``_MAP_FIELDS``) keep their values. Numbers are kept."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            item = strip_empty(item, key in _MAP_FIELDS and isinstance(item, dict))
            if not in_map and (item is False or item == "" or item == [] or item == {}):
                continue
            out[key] = item
        return out
    if isinstance(value, list):
        return [strip_empty(item) for item in value]
    return value


def _builtin(resource: Any) -> bool:
    group = getattr(resource, "group", "") or ""
    return "." not in group or group.endswith(".k8s.io")


def _error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    # details given, so kmock does not put a server traceback into the Status.
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {"causes": []})


@attrs.define(kw_only=True)
class K8sEmulator(kmock.KubernetesEmulator):
    """kmock's stateful API server with resourceVersions, real watch semantics and standard errors (module doc)."""

    _rv: int = attrs.field(default=0, init=False)
    # Per resource: the events emitted, with their resourceVersion, for watches that resume from one.
    _events: dict[Any, list[tuple[int, dict[str, Any]]]] = attrs.field(factory=dict, init=False)
    # Events up to this resourceVersion were compacted away: a watch resuming from before it gets 410 Expired.
    _compacted_rv: int = attrs.field(default=0, init=False)
    # What a create/patch/delete request answers (the object as stored by _handle), keyed weakly by the request.
    _answers: weakref.WeakKeyDictionary = attrs.field(factory=weakref.WeakKeyDictionary, init=False)
    # Serialise built-in objects as a real server does: omitempty zero values left out (module doc).
    omit_empty: bool = False
    # Injected failures: each returns an error for a write request it matches, else None (see fail()).
    _faults: list[Callable[[kmock.Request], Any]] = attrs.field(factory=list, init=False)

    def fail(
        self,
        status: int,
        reason: str,
        message: str,
        *,
        method: str | None = None,
        plural: str | None = None,
        name: str | None = None,
        dry_run: bool | None = None,
        times: int | None = None,
        subresource: str | None = None,
    ) -> None:
        """Answer ``status``/``reason``/``message`` (a Kubernetes Status) to writes (POST, PATCH, DELETE) matching
        ``method``, resource ``plural``, object ``name`` (for POST: the body's metadata.name), ``subresource`` (None:
        any; "": the main resource only) and ``dry_run`` (None: both), at most ``times`` times (None: always), before
        anything is stored."""
        remaining = [times]

        def fault(request: kmock.Request) -> Any:
            verb = getattr(request.method, "value", str(request.method)).upper()
            if verb not in ("POST", "PATCH", "DELETE") or request.resource is None:
                return None
            target = request.name
            if target is None and isinstance(request.data, dict):
                target = (request.data.get("metadata") or {}).get("name")
            if (
                (method is not None and verb != method.upper())
                or (plural is not None and request.resource.plural != plural)
                or (name is not None and target != name)
                or (subresource is not None and (request.subresource or "") != subresource)
                or (dry_run is not None and _dry_run(request) != dry_run)
            ):
                return None
            if remaining[0] is not None:
                if remaining[0] <= 0:
                    return None
                remaining[0] -= 1
            return _error(status, reason, message, name=target or "", kind=request.resource.plural)

        self._faults.append(fault)

    def require_role_refs(self) -> None:
        """Creating a RoleBinding whose ``roleRef`` names a Role absent from storage answers 404 NotFound, as
        kube-apiserver's RoleBinding storage does for a caller without the ``bind`` verb (it resolves the Role's rules
        to prevent escalation). A dry-run create of the Role stores nothing, so a RoleBinding dry run after it still
        gets the 404. Installed as a fault (``clear_faults`` removes it)."""

        def fault(request: kmock.Request) -> Any:
            verb = getattr(request.method, "value", str(request.method)).upper()
            if verb != "POST" or request.resource is None or request.resource.plural != "rolebindings":
                return None
            ref = ((request.data or {}).get("roleRef") or {}) if isinstance(request.data, dict) else {}
            if ref.get("kind") != "Role":
                return None
            namespace = request.namespace or ((request.data.get("metadata") or {}).get("namespace"))
            if any(
                res.plural == "roles" and ns == namespace and name == ref.get("name") and not obj.deleted
                for (res, ns, name), obj in self.objects.items()
            ):
                return None
            return _error(
                404,
                "NotFound",
                f'roles.rbac.authorization.k8s.io "{ref.get("name")}" not found',
                name=ref.get("name") or "",
                group="rbac.authorization.k8s.io",
                kind="roles",
            )

        self._faults.append(fault)

    def clear_faults(self) -> None:
        self._faults.clear()

    def _out(self, resource: Any, raw: dict[str, Any]) -> dict[str, Any]:
        """What the server stores/returns for ``raw`` (omit_empty applied to built-in kinds)."""
        return strip_empty(raw) if self.omit_empty and _builtin(resource) else raw

    @property
    def resource_version(self) -> int:
        """The current (latest) global resourceVersion."""
        return self._rv

    def compact(self) -> None:
        """Forget all logged events, as etcd compaction does: a watch resuming from an older resourceVersion gets a
        410 Expired ERROR event and must re-list."""
        self._events.clear()
        self._compacted_rv = self._rv

    # --- writes ---------------------------------------------------------------------------------------------------

    async def _emit(self, resource: Any, event_type: str, raw: dict[str, Any]) -> None:
        """Log and publish one watch event; called with self._lock held, so watchers see events in rv order."""
        event = {"type": event_type, "object": copy.deepcopy(raw)}
        self._events.setdefault(resource, []).append((self._rv, event))
        await self._buses[resource].put(event)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _info(self, resource: Any) -> Any:
        try:
            return self.resources[resource]
        except KeyError:
            return None

    async def _handle(self, request: kmock.Request) -> Any:
        gc_key = None
        if request.resource is not None and request.action in (action.CREATE, action.UPDATE, action.DELETE):
            for fault in list(self._faults):
                error = fault(request)
                if error is not None:
                    raise error
            dry = _dry_run(request)
            async with self._lock:
                if request.action == action.CREATE:
                    self._answers[request] = await self._create(request, dry)
                elif request.name is not None and request.action == action.UPDATE:
                    self._answers[request], gc_key = await self._patch(request, dry)
                elif request.name is not None and request.action == action.DELETE:
                    self._answers[request] = await self._delete(request, dry)
        try:
            # Skip KubernetesEmulator._handle (its unstamped state changes); serve reactions and fallbacks as usual.
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        finally:
            if gc_key is not None:  # the last finalizer went from an object marked for deletion
                async with self._lock:
                    obj = self.objects[gc_key]
                    if not obj.deleted:
                        raw = copy.deepcopy(obj.raw)
                        raw["metadata"]["resourceVersion"] = self._next_rv()
                        obj.history.append(raw)
                        obj.delete()
                        await self._emit(gc_key[0], "DELETED", raw)

    async def _create(self, request: kmock.Request, dry: bool = False) -> dict[str, Any]:
        raw = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        raw = self._out(request.resource, raw)
        meta = raw.setdefault("metadata", {})
        info = self._info(request.resource)
        namespace = request.namespace or meta.get("namespace")
        if namespace and (info is None or info.namespaced is not False):
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        name = meta.get("name")
        if not name:
            raise _error(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        key = (request.resource, meta.get("namespace"), name)
        if key in self.objects and not self.objects[key].deleted:
            raise _error(
                409,
                "AlreadyExists",
                f'{request.resource.plural} "{name}" already exists',
                name=name,
                kind=request.resource.plural,
            )
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            generation=1,
        )
        meta.pop("deletionTimestamp", None)
        if dry:  # as the real server: the object as it would be, no resourceVersion, nothing stored
            return raw
        meta["resourceVersion"] = self._next_rv()
        if key in self.objects:
            self.objects[key].create(raw)
        else:
            self.objects[key] = raw
        await self._emit(request.resource, "ADDED", raw)
        return raw

    def _existing(self, request: kmock.Request) -> tuple[Any, Any]:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise _error(
                404,
                "NotFound",
                f'{request.resource.plural} "{request.name}" not found',
                name=request.name,
                kind=request.resource.plural,
            )
        return key, self.objects[key]

    async def _patch(self, request: kmock.Request, dry: bool = False) -> tuple[dict[str, Any], Any]:
        key, obj = self._existing(request)
        old = copy.deepcopy(obj.raw)
        patch = request.data
        try:
            if isinstance(patch, list):  # application/json-patch+json
                new = jsonpatch.apply_patch(old, patch, in_place=False)
            elif isinstance(patch, dict):  # merge or strategic-merge (applied as merge, as kmock does)
                wanted_rv = (patch.get("metadata") or {}).get("resourceVersion")
                if wanted_rv is not None and str(wanted_rv) != old["metadata"].get("resourceVersion"):
                    raise _error(
                        409,
                        "Conflict",
                        f"Operation cannot be fulfilled on {request.resource.plural} "
                        f'"{request.name}": the object has been modified; please apply your changes to '
                        f"the latest version and try again",
                        name=request.name,
                        kind=request.resource.plural,
                    )
                new = merge_patch(old, patch)
            else:
                raise _error(400, "BadRequest", "the patch body is neither a JSON object nor a JSON-patch list")
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            # The real server rejects a failed `test` op (kopf's optimistic finalizer removal) with 422, not 500.
            raise _error(
                422,
                "Invalid",
                f"the server rejected our request due to an error in our request: {exc}",
                name=request.name,
                kind=request.resource.plural,
            ) from None
        if not isinstance(new, dict):
            raise _error(422, "Invalid", "the patched object is not a JSON object")
        new = self._out(request.resource, new)

        info = self._info(request.resource)
        has_status = info is not None and "status" in (info.subresources or ())
        if request.subresource == "status":  # the /status subresource changes only .status
            new = (
                {**old, "status": new.get("status")}
                if "status" in new
                else {k: v for k, v in old.items() if k != "status"}
            )
        elif has_status:  # and the main resource ignores .status when /status exists
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        # Server-owned metadata cannot be patched.
        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "generation", "name", "namespace", "deletionTimestamp"):
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        if new == old:  # a no-op patch changes nothing, not even the resourceVersion (as the real server)
            return old, None
        body = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if body(new) != body(old):
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        if dry:
            return new, None
        meta["resourceVersion"] = self._next_rv()
        obj.history.append(new)
        await self._emit(request.resource, "MODIFIED", new)
        gc_key = key if meta.get("deletionTimestamp") and not meta.get("finalizers") else None
        return new, gc_key

    async def _delete(self, request: kmock.Request, dry: bool = False) -> dict[str, Any]:
        key, obj = self._existing(request)
        raw = copy.deepcopy(obj.raw)
        meta = raw["metadata"]
        if meta.get("deletionTimestamp") or dry:
            return raw  # already being deleted (waits for its finalizers), or a dry run
        if meta.get("finalizers"):
            meta["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            meta["deletionGracePeriodSeconds"] = 0
            meta["resourceVersion"] = self._next_rv()
            obj.history.append(raw)
            await self._emit(request.resource, "MODIFIED", raw)
            return raw
        meta["resourceVersion"] = self._next_rv()
        obj.history.append(raw)
        obj.delete()
        await self._emit(request.resource, "DELETED", raw)
        return raw

    async def _serve_create(self, request: kmock.Request) -> Any:
        return self._answers.get(request) or await super()._serve_create(request)

    async def _serve_update(self, request: kmock.Request) -> Any:
        return self._answers.get(request) or await super()._serve_update(request)

    async def _serve_delete(self, request: kmock.Request) -> Any:
        return self._answers.get(request) or await super()._serve_delete(request)

    # --- reads ----------------------------------------------------------------------------------------------------

    def _matches(self, request: kmock.Request, resource: Any, namespace: str | None, name: str | None) -> bool:
        return (
            resource == request.resource
            and (request.namespace is None or namespace == request.namespace)
            and (request.name is None or name == request.name)
        )

    def _live(self, request: kmock.Request) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj.raw)
            for (resource, namespace, name), obj in self.objects.items()
            if not obj.deleted and self._matches(request, resource, namespace, name)
        ]

    async def _serve_list(self, request: kmock.Request) -> Any:
        if request.resource not in self._get_resources():
            raise _error(404, "NotFound", f"the server could not find the requested resource ({request.resource})")
        info = self._info(request.resource)
        resource = request.resource
        async with self._lock:
            items = self._live(request)
            rv = self._rv
        return {
            "apiVersion": f"{resource.group}/{resource.version}" if resource.group else resource.version,
            "kind": f"{info.kind}List" if info is not None and info.kind else "List",
            "metadata": {"resourceVersion": str(rv)},
            "items": items,
        }

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now: the client waits for them even when nothing happens
        resource = request.resource
        since_param = request.params.get("resourceVersion") or "0"
        timeout_s = float(request.params["timeoutSeconds"]) if request.params.get("timeoutSeconds") else None
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        bus = self._buses[resource]
        async with self._lock:
            # Subscribe first, then snapshot, both under the write lock: no event falls in between.
            mark = await bus.mark()
            if since_param == "0":  # "any": the current state as synthetic ADDED events, then changes
                initial = [{"type": "ADDED", "object": raw} for raw in self._live(request)]
            elif int(since_param) < self._compacted_rv:
                initial = [
                    {
                        "type": "ERROR",
                        "object": {
                            "apiVersion": "v1",
                            "kind": "Status",
                            "metadata": {},
                            "status": "Failure",
                            "code": 410,
                            "reason": "Expired",
                            "message": f"too old resource version: {since_param} ({self._rv})",
                        },
                    }
                ]
            else:
                since = int(since_param)
                initial = [
                    copy.deepcopy(event)
                    for rv, event in self._events.get(resource, [])
                    if rv > since
                    and self._matches(
                        request,
                        resource,
                        event["object"]["metadata"].get("namespace"),
                        event["object"]["metadata"].get("name"),
                    )
                ]
        try:
            for event in initial:
                yield event
            if initial and initial[0]["type"] == "ERROR":
                return
            while True:
                remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if remaining is not None and remaining <= 0:
                    return
                try:
                    event = await asyncio.wait_for(bus.get(since=mark), remaining)
                except TimeoutError:
                    return
                meta = event["object"].get("metadata", {})
                if self._matches(request, resource, meta.get("namespace"), meta.get("name")):
                    yield event
        finally:
            await bus.unmark(mark)


def _dry_run(request: kmock.Request) -> bool:
    """``?dryRun=All`` (the only value the API defines)."""
    return (request.params or {}).get("dryRun") == "All"


def write_kubeconfig(path: Any, server_url: str) -> str:
    """Write a kubeconfig (one cluster, one user with a dummy token, one current context) for ``server_url``."""
    import yaml

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server_url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": "default"}}
        ],
    }
    path = str(path)
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


@pytest_asyncio.fixture
async def k8s(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[K8sEmulator, Any]]:
    """``(emulator, kubernetes.client.ApiClient)``: a K8sEmulator served over HTTP on 127.0.0.1 with kmock's bundled
    builtin resources (discovery.k8s.io/v1 EndpointSlices, apps/v1, core v1, ...), and a client configured for it
    from a kubeconfig that is also this test's default kubeconfig (in-cluster config is hidden)."""
    import kubernetes

    emulator = K8sEmulator()
    emulator.resources.load_bundled()
    async with emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        config_path = write_kubeconfig(tmp_path / "kubeconfig", url)
        # The client reads $KUBECONFIG into this module global at import time, so patch the global itself.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", config_path)
        monkeypatch.setenv("KUBECONFIG", config_path)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
        api = kubernetes.config.new_client_from_config(config_file=config_path)
        try:
            yield emulator, api
        finally:
            api.close()
