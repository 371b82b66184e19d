"""The kopf handlers: one level-based reconcile of an InferenceService, run on every trigger.

Triggers (``build_registry``), all ending in ``Reconciler.reconcile``:

- ``@kopf.on.create / on.update / on.resume`` of ``radixserve.io/v1alpha1`` inferenceservices: a spec change
  (including ``spec.replicas`` written through the scale subresource by ``kubectl scale`` or the HPA) or operator
  start;
- ``@kopf.timer`` every ``resync_seconds``: drift repair (a hand-edited or deleted child comes back) and status that
  follows the pods even when no watch event was seen;
- ``@kopf.on.event`` for every child kind labelled ``radixserve.io/inference-service``: a child changed or deleted by
  someone else reconciles its owner within seconds. Events that cannot matter are skipped: the operator's own writes
  (recognised by resourceVersion, and its own prune deletions), and writes that changed only the ``status`` of a
  kind other than Deployment (an HPA's controller rewrites its status every ~15 s). Deployment events always count:
  their status feeds the InferenceService's. "Only status changed" is decided by comparing everything but status
  and server-written metadata (``_fingerprint``), not ``metadata.generation``: the same rule then serves kinds that
  have no generation (ConfigMap, Service, ServiceAccount, RBAC) and catches hand-edited labels, which bump none.
  Bursts are coalesced per InferenceService (at most one reconcile waiting while one runs), so creating nine
  children does not cause nine more reconciles. Per-InferenceService state is only created for an owner that exists.
- ``@kopf.on.event`` for ``discovery.k8s.io/v1`` EndpointSlices labelled ``radixserve.io/inference-service`` (the
  EndpointSlice controller copies the Service's labels onto its slices) that belong to the engine Service: Ready
  needs a ready endpoint, and on a real cluster the slice usually becomes ready after the Deployment's status, so
  without this watch Ready waited for the next resync. Same path as a child's event (``child_changed``); the
  operator never writes slices, so every such event is someone else's, and one whose content did not change is
  skipped.

A reconcile: parse (``InferenceService.model_validate``; a pydantic or render error -> status from
``invalid_spec_status``, a Warning Event on the transition, nothing applied, no retry: an invalid spec is the user's to
fix and kopf retrying it would only repeat the same message; logged at WARNING once per distinct message), render,
list the live children, plan every create/patch/delete (``apply.plan``), send each write with ``dryRun=All`` and
only when all pass for real (``apply.execute``), then read back the Deployments and the engine Service's
EndpointSlices, and patch ``status`` through the status subresource when it changed (``status.compute_status`` with
the previous conditions). A write the API server refuses for good (a child name taken by an object this
InferenceService does not control, 403, 422, 400: ``apply.ApplyRejected``) leaves nothing half-applied when the dry
run caught it, and sets Degraded (reason ``ChildConflict``, ``Forbidden`` or ``ApplyRejected``, message naming
Kind/name and the server's answer) and Ready False; it is counted in ``reconcile_errors_total`` as ``http_NNN`` and
NOT raised (kopf would retry it hot): the resync timer tries again. 429/5xx/connection errors (an API server in
trouble, an admission webhook that is down) are retried with backoff; what still fails first sets Degraded (reason
``ApplyFailed``, or ``APIUnavailable`` when even listing the children failed; the message names Kind/name, the
server's answer and whether the spec is partly applied) and Ready False, then is raised as ``kopf.TemporaryError``
(kopf retries; if the status write fails too, the apply's error is still the one raised). Events: each child created or
deleted as it happens, Ready gained or lost, Degraded raised or its message changed (so one Warning per distinct
problem, not one per resync), and a Warning ``APIKeyInPlainText`` when ``spec.*.args`` carry an API key flag.

Deletion: children carry ``ownerReferences`` (controller) to the InferenceService, so the garbage collector deletes
them with it; the operator registers no on.delete handler. kopf itself puts ONE finalizer
(``FINALIZER``) on each InferenceService because a ``@kopf.timer`` requires it (kopf stops the timer, then removes the
finalizer; kopf/on.py: timers and daemons set ``requires_finalizer=True``). The consequence to know: while the
operator is not running, deleting an InferenceService waits until it runs again (or the finalizer is removed by hand).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypedDict, cast

import kopf
import pydantic

from radixserve.contracts import constants
from radixserve.operator import apply as applier
from radixserve.operator.apply import KubeApi
from radixserve.operator.cache_heat import DELETION_COST_ANNOTATION, CacheHeat, deletion_costs, engine_pods
from radixserve.operator.metrics import OperatorMetrics
from radixserve.operator.render import CHILD_TYPES, ChildType, RenderOptions, render_children
from radixserve.operator.spec import InferenceService, check_name, format_validation_error
from radixserve.operator.status import ApplyError, ObservedChildren, compute_status, invalid_spec_status

__all__ = [
    "INFERENCE_SERVICES",
    "ENDPOINT_SLICES",
    "FINALIZER",
    "Reconciler",
    "build_registry",
    "configure_settings",
    "format_validation_error",
    "QuietHandlerSuccess",
]

INFERENCE_SERVICES = ChildType(
    f"{constants.API_GROUP}/{constants.API_VERSION}", constants.CRD_KIND, constants.CRD_PLURAL
)
ENDPOINT_SLICES = ChildType("discovery.k8s.io/v1", "EndpointSlice", "endpointslices")
PODS = ChildType("v1", "Pod", "pods")  # engine pods: read for cache heat, annotated before a scale-in
FINALIZER = f"{constants.API_GROUP}/kopf-finalizer"
_TYPES_BY_KIND = {(t.api_version, t.kind): t for t in CHILD_TYPES}


def _condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any]:
    return next((c for c in conditions or [] if c.get("type") == type_), {})


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A kopf Body (a read-only mapping view) as plain nested dicts."""

    def conv(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list):
            return [conv(x) for x in v]
        return v

    plain: dict[str, Any] = conv(body)
    return plain


def _event_target(obj: dict[str, Any]) -> kopf.Body:
    """``obj`` for kopf.info / kopf.warn: annotated for kopf's Body view, they read any mapping (apiVersion, kind,
    metadata; kopf's ``build_object_reference``)."""
    return cast(kopf.Body, obj)


def _fingerprint(obj: Mapping[str, Any]) -> str:
    """A digest of everything in a child except ``status`` and the metadata the server changes on every write
    (resourceVersion, managedFields, generation): equal digests mean a status-only (or no-op) write."""
    meta = {
        k: v
        for k, v in (obj.get("metadata") or {}).items()
        if k not in ("resourceVersion", "managedFields", "generation")
    }
    content = {k: v for k, v in obj.items() if k not in ("status", "metadata")}
    return hashlib.sha256(json.dumps([meta, content], sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class _OwnerState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[tuple[tuple[str, str, str], str | None]] = field(default_factory=list)
    waiting: bool = False
    # (plural, namespace, name) -> resourceVersion of each child as the operator last wrote or compared it.
    seen: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # (plural, namespace, name) -> _fingerprint of each child as last written, compared or reported by a watch event.
    fingerprints: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # Children this operator deleted (prune) whose DELETED watch event has not arrived yet.
    deleted: set[tuple[str, str, str]] = field(default_factory=set)
    # The last problem logged at WARNING (an invalid spec's or a refused apply's message): logged again only when
    # it changes, not at every resync.
    warned: str | None = None
    # The status this process last wrote (None: none yet; the object's own status is then the reference).
    status: dict[str, Any] | None = None
    # The plain-text API key warning last posted (an Event once per distinct message, not at every resync).
    plain_text_warned: str | None = None


class Reconciler:
    """Reconciles InferenceServices (module doc). Thread-safe: kopf runs these sync handlers in its thread pool; one
    InferenceService is reconciled by one thread at a time.

    ``api``: the REST client; ``options``: rendering defaults (image); ``metrics``: where reconciles are counted;
    ``clock``: returns the current UTC time (condition timestamps); ``heat``: the engines' cache heat (cache-aware
    scale-in, ``cache_heat.py``; default: a ``CacheHeat`` reading the pods' ``/metrics``).
    """

    def __init__(
        self,
        api: KubeApi,
        options: RenderOptions,
        metrics: OperatorMetrics,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        heat: CacheHeat | None = None,
    ) -> None:
        self.api = api
        self.options = options
        self.metrics = metrics
        self.clock = clock
        self.heat = heat if heat is not None else CacheHeat()
        self._guard = threading.Lock()
        self._owners: dict[tuple[str, str], _OwnerState] = {}

    # --- bookkeeping ----------------------------------------------------------------------------------------------

    def _owner(self, namespace: str, name: str) -> _OwnerState:
        with self._guard:
            state = self._owners.get((namespace, name))
            if state is None:
                state = self._owners[(namespace, name)] = _OwnerState()
                self.metrics.managed.set(len(self._owners))
            return state

    def forget(self, namespace: str, name: str) -> None:
        """The InferenceService is gone: drop its state (and the managed gauge follows)."""
        with self._guard:
            self._owners.pop((namespace, name), None)
            self.metrics.managed.set(len(self._owners))
        self.heat.forget(f"{namespace}/{name}")

    def managed(self) -> set[tuple[str, str]]:
        """(namespace, name) of every InferenceService the operator holds state for."""
        with self._guard:
            return set(self._owners)

    def _remember(self, state: _OwnerState, rtype: applier.ResourceType, obj: dict[str, Any] | None) -> None:
        meta = (obj or {}).get("metadata") or {}
        key = (rtype.plural, meta.get("namespace", ""), meta.get("name", ""))
        with self._guard:
            if meta.get("resourceVersion"):
                state.seen[key] = meta["resourceVersion"]
            if obj:
                state.fingerprints[key] = _fingerprint(obj)

    def _warn_once(
        self, state: _OwnerState, logger: logging.Logger | logging.LoggerAdapter[Any], message: str, *args: Any
    ) -> None:
        """Log at WARNING when ``message % args`` differs from the last one warned for this owner, else at DEBUG."""
        text = message % args
        level = logging.DEBUG if state.warned == text else logging.WARNING
        state.warned = text
        logger.log(level, "%s", text)

    # --- triggers ---------------------------------------------------------------------------------------------------

    def reconcile(
        self, body: Mapping[str, Any], kind: str, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> None:
        """Reconcile one InferenceService ``body`` (trigger ``kind``: create, update, resume, timer, child). Raises
        kopf.TemporaryError when the API server keeps failing (kopf retries change handlers)."""
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):  # going away: no state for it (forget() may already have run)
            self.metrics.reconciles.labels(kind=kind, result="success").inc()
            return
        state = self._owner(meta.get("namespace", ""), meta["name"])
        with state.lock:
            self._reconcile_locked(state, _plain(body), kind, logger)

    def child_changed(
        self, event_type: str | None, child: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> None:
        """A labelled child was added, modified or deleted: reconcile its owner when the event can matter (module
        doc: not the operator's own writes, not status-only writes of kinds other than Deployment). Events arriving
        while a reconcile of the same owner runs are coalesced. State is created only for an owner that exists and
        is not being deleted (the garbage collector's deletions of a deleted owner's children must not bring it
        back)."""
        meta = child.get("metadata") or {}
        owner_name = (meta.get("labels") or {}).get(constants.LABEL_INFERENCE_SERVICE)
        namespace = meta.get("namespace", "")
        if not owner_name or event_type is None:  # None: kopf's initial listing (on.resume covers startup)
            return
        kind = child.get("kind") or ""
        rtype = next((t for t in CHILD_TYPES if t.kind == kind), None)
        plural = rtype.plural if rtype else kind.lower() + "s"
        key = (plural, namespace, meta.get("name", ""))
        with self._guard:
            state = self._owners.get((namespace, owner_name))
        if state is None:
            owner = self.api.call(
                f"get InferenceService {namespace}/{owner_name}",
                self.api.get,
                INFERENCE_SERVICES,
                namespace,
                owner_name,
            )
            if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
                return  # the owner is gone or going: the garbage collector takes the child
            state = self._owner(namespace, owner_name)
        if not self._matters(state, event_type, kind, key, child):
            return
        with self._guard:
            state.pending.append((key, meta.get("resourceVersion")))
            if state.waiting:
                return  # the reconcile already waiting will look at this event too
            state.waiting = True
        with state.lock:
            with self._guard:
                events, state.pending, state.waiting = state.pending, [], False
                own = all(rv is not None and state.seen.get(k) == rv for k, rv in events)
            if own:
                return
            isvc = self.api.call(
                f"get InferenceService {namespace}/{owner_name}",
                self.api.get,
                INFERENCE_SERVICES,
                namespace,
                owner_name,
            )
            if isvc is None or (isvc.get("metadata") or {}).get("deletionTimestamp"):
                return  # the owner is gone; the garbage collector takes the child
            logger.debug("child %s changed (%s): reconciling %s", key, event_type, owner_name)
            self._reconcile_locked(state, isvc, "child", logger)

    def _matters(
        self, state: _OwnerState, event_type: str, kind: str, key: tuple[str, str, str], child: Mapping[str, Any]
    ) -> bool:
        """Whether a child's watch event can change what a reconcile does: a deletion (unless the operator's own
        prune), any Deployment event (its status feeds the InferenceService's), and for other kinds a change of
        anything but ``status`` (an HPA's controller rewrites its status every ~15 s; that alone is skipped).

        Comparing the non-status content (``_fingerprint``) rather than ``metadata.generation``: it works the same
        for kinds without a generation (ConfigMap, Service, ServiceAccount, RBAC) and also sees hand edits of labels
        and annotations, which the operator manages but which bump no generation."""
        if event_type == "DELETED":
            with self._guard:
                if key in state.deleted:
                    state.deleted.discard(key)
                    return False
            return True
        if kind == "Deployment":
            return True
        digest = _fingerprint(_plain(child))
        with self._guard:
            if state.fingerprints.get(key) == digest:
                return False
            state.fingerprints[key] = digest
        return True

    # --- the reconcile ----------------------------------------------------------------------------------------------

    def _reconcile_locked(
        self, state: _OwnerState, body: dict[str, Any], kind: str, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> None:
        start = time.perf_counter()
        try:
            result, error_reason = self._reconcile(state, body, kind, logger)
        except Exception as exc:
            status = getattr(exc.__cause__, "status", None)
            reason = f"http_{status}" if status else type(exc).__name__
            self.metrics.reconcile_errors.labels(kind=kind, reason=reason).inc()
            self.metrics.reconciles.labels(kind=kind, result="error").inc()
            raise
        finally:
            self.metrics.reconcile_duration.observe(time.perf_counter() - start)
        if error_reason is not None:
            self.metrics.reconcile_errors.labels(kind=kind, reason=error_reason).inc()
        self.metrics.reconciles.labels(kind=kind, result=result).inc()

    def _reconcile(
        self, state: _OwnerState, body: dict[str, Any], kind: str, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> tuple[str, str | None]:
        """One reconcile; returns (result for reconciles_total, reason for reconcile_errors_total or None)."""
        meta = body["metadata"]
        name, namespace = meta["name"], meta.get("namespace", "")
        if meta.get("deletionTimestamp"):
            return "success", None  # going away: the garbage collector removes the children
        # The conditions last written (by this process if it wrote any: the body may predate that write).
        previous = ((state.status if state.status is not None else body.get("status")) or {}).get("conditions")
        try:
            check_name(name)
            isvc = InferenceService.model_validate(body)
            desired = render_children(isvc, self.options)
        except pydantic.ValidationError as exc:
            return self._invalid(state, body, format_validation_error(exc), previous, logger), None
        except ValueError as exc:
            return self._invalid(state, body, str(exc), previous, logger), None

        self._warn_plain_text_keys(state, body, isvc, logger)
        if isvc.spec.autoscaling is not None and isvc.spec.replicas is None:
            # The scale subresource reads an absent spec.replicas as 0, and an HPA whose target has 0 replicas
            # disables itself (ScalingDisabled): start the HPA from minReplicas.
            self.api.call(
                f"default spec.replicas of InferenceService {namespace}/{name}",
                self.api.merge_patch,
                INFERENCE_SERVICES,
                namespace,
                name,
                {"spec": {"replicas": isvc.spec.desired_replicas()}},
            )
            logger.info("spec.replicas unset under autoscaling: set to minReplicas %d", isvc.spec.desired_replicas())

        owner_uid = meta.get("uid")
        selector = {constants.LABEL_INFERENCE_SERVICE: name}
        # Deployments as listed, controlled by this InferenceService: the status when an apply is refused.
        current: dict[tuple[str, str], dict[str, Any]] = {}
        changes: list[applier.Change] = []

        def record(change: applier.Change, result: applier.ApplyResult) -> None:
            what = f"{change.rtype.kind}/{change.name}"
            if result.action == "deleted":
                with self._guard:
                    state.deleted.add((change.rtype.plural, namespace, change.name))
                kopf.info(_event_target(body), reason="Deleted", message=f"deleted {what} (no longer desired)")
                return
            self._remember(state, change.rtype, result.obj)
            current[(change.rtype.kind, change.name)] = result.obj
            if result.action == "created":
                # at once: a later failure keeps it
                kopf.info(_event_target(body), reason="Created", message=f"created {what}")
            elif result.action == "patched":
                logger.info(
                    "patched %s: %s", what, sorted(k for k in result.patch or {} if k != "metadata") or ["metadata"]
                )

        phase = "read"  # how far the apply got: "read" (listing), "dry-run", "write" (real writes under way)
        try:
            for rtype in CHILD_TYPES:
                live = self.api.call(f"list {rtype.plural}", self.api.list, rtype, namespace, selector)
                for obj in live:
                    if rtype.kind == "Deployment" and applier.is_owned_by(obj, owner_uid):
                        current[(rtype.kind, obj["metadata"]["name"])] = obj
                wanted = [c for c in desired if (c["apiVersion"], c["kind"]) == (rtype.api_version, rtype.kind)]
                changes += applier.plan(rtype, wanted, live, owner_uid)
            # Creates and patches first, deletes last; every write is dry-run before any is made.
            ordered = [c for c in changes if c.action != "delete"] + [c for c in changes if c.action == "delete"]
            writes = [c for c in ordered if c.action != "unchanged"]
            if writes:
                phase = "dry-run"
                applier.execute(self.api, writes, dry_run=True)
                phase = "write"
            engine = current.get(("Deployment", constants.engine_deployment_name(name)))
            self._cache_heat(body, isvc, engine, logger)  # before the Deployment's replicas drop: the coldest goes
            applier.execute(self.api, ordered, dry_run=False, on_result=record)
        except applier.ApplyRejected as exc:
            self._warn_once(state, logger, "not applied (%s, HTTP %d): %s", exc.reason, exc.http_status, exc)
            refused = ApplyError(exc.reason, str(exc))
            self._observe_and_write(state, isvc, body, current, previous, logger, refused)
            return "error", f"http_{exc.http_status}"
        except kopf.TemporaryError as exc:
            # 429/5xx/connection errors (an API server in trouble, a webhook that is down: 500 "failed calling
            # webhook") after the bounded retries. kopf retries later; meanwhile the status says so instead of
            # standing still (reason APIUnavailable when even reading the children failed, else ApplyFailed).
            reason = "APIUnavailable" if phase == "read" else "ApplyFailed"
            done = {"read": "nothing applied", "dry-run": "nothing applied", "write": "the spec is partly applied"}[
                phase
            ]
            failed = ApplyError(reason, f"{exc}; {done}, the operator retries")
            try:
                self._observe_and_write(state, isvc, body, current, previous, logger, failed)
            except Exception as status_exc:  # noqa: BLE001 - the apply's error is the one to raise
                logger.warning("status not written either (%s): %s", failed.reason, status_exc)
            raise

        state.warned = None
        self._observe_and_write(state, isvc, body, current, previous, logger, None)
        return "success", None

    def _cache_heat(
        self,
        body: dict[str, Any],
        isvc: InferenceService,
        engine: dict[str, Any] | None,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """Cache-aware scale-in (``cache_heat.py``): read the engines' heat when it is due, and when this reconcile
        lowers the engine Deployment's replicas (``engine``: the live one), read it again and write each engine pod's
        ``controller.kubernetes.io/pod-deletion-cost`` from it first, so the ReplicaSet controller removes the coldest
        pods. Never fails the reconcile: a pod list or annotation that fails is logged and the scale-in goes on."""
        meta = body["metadata"]
        name, namespace = meta["name"], meta.get("namespace", "")
        owner = f"{namespace}/{name}"
        live = ((engine or {}).get("spec") or {}).get("replicas")
        wanted = isvc.spec.desired_replicas()
        scale_in = isinstance(live, int) and wanted < live
        if not scale_in and not self.heat.due(owner):
            return
        labels = {constants.LABEL_INFERENCE_SERVICE: name, constants.LABEL_COMPONENT: constants.COMPONENT_ENGINE}
        try:
            pods = engine_pods(self.api.list(PODS, namespace, labels))
        except Exception as exc:  # noqa: BLE001 - the heat is an optimisation; the reconcile goes on
            logger.warning("cache heat: cannot list the engine pods: %s", exc)
            return
        self.heat.sample(owner, pods)
        if not scale_in or not pods:
            return
        costs = deletion_costs({p.name: self.heat.heat(owner, p) for p in pods})
        for pod in pods:
            if pod.cost == costs[pod.name]:
                continue
            patch = {"metadata": {"annotations": {DELETION_COST_ANNOTATION: str(costs[pod.name])}}}
            try:
                self.api.merge_patch(PODS, namespace, pod.name, patch)
            except Exception as exc:  # noqa: BLE001 - a pod gone meanwhile, RBAC: the scale-in still happens
                logger.warning("cache heat: pod %s not annotated: %s", pod.name, exc)
        ranked = ", ".join(f"{n} {c}" for n, c in sorted(costs.items(), key=lambda kv: (kv[1], kv[0])))
        message = (
            f"engines {live} -> {wanted}: pod-deletion-cost from cache heat (cached tokens/min), coldest first: "
            f"{ranked}"
        )
        logger.info("%s", message)
        kopf.info(_event_target(body), reason="ScaleIn", message=message)

    def _warn_plain_text_keys(
        self,
        state: _OwnerState,
        body: dict[str, Any],
        isvc: InferenceService,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """A Warning Event (reason ``APIKeyInPlainText``) and a log line when ``spec.*.args`` carry an API key flag:
        it is then stored in plain text in the InferenceService, its ConfigMap and the pod spec. Once per distinct
        message (and again after an operator restart); the spec is still applied, the flag still works."""
        found = isvc.spec.plain_text_keys()
        message = None
        if found:
            message = (
                f"{', '.join(found)}: an API key in args is stored in plain text (this InferenceService, its ConfigMap "
                "and the pod spec); put it in a Secret and use spec.router.apiKeySecretRef (the clients' key) or "
                "spec.engine.apiKeySecretRef (the engines' key, also given to the router)"
            )
        if message == state.plain_text_warned:
            return
        state.plain_text_warned = message
        if message:
            logger.warning("%s", message)
            kopf.warn(_event_target(body), reason="APIKeyInPlainText", message=message)

    def _observe_and_write(
        self,
        state: _OwnerState,
        isvc: InferenceService,
        body: dict[str, Any],
        current: dict[tuple[str, str], dict[str, Any]],
        previous: list[dict[str, Any]] | None,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        refused: ApplyError | None,
    ) -> None:
        """Read the engine Service's EndpointSlices, compute the status from them and ``current`` (Deployments by
        (kind, name)) and write it."""
        meta = body["metadata"]
        name, namespace = meta["name"], meta.get("namespace", "")
        engine_svc = constants.engine_deployment_name(name)
        slices = self.api.call(
            f"list endpointslices of {engine_svc}",
            self.api.list,
            ENDPOINT_SLICES,
            namespace,
            {constants.LABEL_SERVICE_NAME: engine_svc},
        )
        observed = ObservedChildren(
            engine_deployment=current.get(("Deployment", constants.engine_deployment_name(name))),
            router_deployment=current.get(("Deployment", constants.router_deployment_name(name))),
            endpoint_slices=slices,
            apply_error=refused,
        )
        status = compute_status(isvc, observed, now=self.clock(), previous_conditions=previous)
        self._write_status(state, body, status, logger)

    def _invalid(
        self,
        state: _OwnerState,
        body: dict[str, Any],
        message: str,
        previous: list[dict[str, Any]] | None,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> str:
        meta = body["metadata"]
        self._warn_once(state, logger, "invalid spec, nothing applied: %s", message)
        status = invalid_spec_status(
            meta["name"],
            meta.get("namespace", ""),
            meta.get("generation"),
            message,
            now=self.clock(),
            previous_conditions=previous,
        )
        self._write_status(state, body, status, logger)
        return "invalid_spec"

    def _write_status(
        self,
        state: _OwnerState,
        body: dict[str, Any],
        status: dict[str, Any],
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """Patch ``status`` (whole: fields no longer reported are removed) through the status subresource when it
        differs from the status this process last wrote OR from the live one in ``body`` (someone wiped or edited
        it: ``kubectl edit --subresource=status``, ``status: null``), and post Events for the transitions. Events
        compare with the status this process last wrote when there is one: the body a timer or event handler gets
        may predate that write, and comparing with it would post the same Events twice (a stale body can cost one
        redundant, identical status write, which the server treats as a no-op)."""
        old = body.get("status") or {}
        current = state.status if state.status is not None else old
        if status == current and status == old:
            return
        meta = body["metadata"]
        patch = {"status": {**{k: None for k in {**old, **current} if k not in status}, **status}}
        self.api.call(
            f"patch status of InferenceService {meta.get('namespace')}/{meta['name']}",
            self.api.merge_patch,
            INFERENCE_SERVICES,
            meta.get("namespace"),
            meta["name"],
            patch,
            "status",
        )
        state.status = status
        before, after = current.get("conditions"), status.get("conditions")
        was_ready = _condition(before, "Ready").get("status") == "True"
        ready = _condition(after, "Ready")
        if ready.get("status") == "True" and not was_ready:
            kopf.info(_event_target(body), reason="Ready", message=ready.get("message", ""))
        elif was_ready and ready.get("status") != "True":
            kopf.warn(
                _event_target(body), reason="NotReady", message=f"{ready.get('reason')}: {ready.get('message', '')}"
            )
        degraded, was = _condition(after, "Degraded"), _condition(before, "Degraded")
        if degraded.get("status") == "True" and (
            was.get("status") != "True"
            or (was.get("reason"), was.get("message")) != (degraded.get("reason"), degraded.get("message"))
        ):
            kopf.warn(
                _event_target(body), reason=degraded.get("reason", "Degraded"), message=degraded.get("message", "")
            )
        logger.debug("status: %s", {c["type"]: c["status"] for c in after or []})


class QuietHandlerSuccess(logging.Filter):
    """A filter for kopf's ``kopf.objects`` logger: its INFO line "Handler 'child-...' succeeded." for every child
    watch event, and "Handler 'forget' succeeded." / "Timer 'resync' succeeded." for every InferenceService event and
    resync tick, are demoted to DEBUG (dropped unless that logger is enabled for DEBUG). Every other line (the
    create/update handlers' success, failures) passes unchanged."""

    HANDLER_IDS = ("child-", "forget", "resync")
    _PREFIXES = ("Handler '", "Timer '")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        if not message.endswith("' succeeded.") or not message.startswith(self._PREFIXES):
            return True
        handler_id = message.split("'", 2)[1]
        if not any(handler_id == h or (h.endswith("-") and handler_id.startswith(h)) for h in self.HANDLER_IDS):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf settings for this operator: progress and diff-base kept in annotations under radixserve.io (the CRD's
    status is structural, so kopf's default ``status.kopf`` would be pruned by the API server), kopf's timer finalizer
    named under radixserve.io, Events only from explicit kopf.info/warn calls (handler logs are not Events), and a
    timer still running at deletion re-checked every 2 s instead of 60."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=constants.API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    # A resync reconcile (a sync handler in a thread) still running when its InferenceService is deleted cannot be
    # interrupted; kopf re-checks whether it has exited after this many seconds (default 60: deletion then took a
    # minute whenever it met a resync in flight).
    settings.background.cancellation_polling = 2.0
    settings.posting.enabled = True
    settings.posting.loggers = False
    settings.posting.level = logging.INFO


class _ResourceSelector(TypedDict):
    """The keyword arguments naming a resource to kopf's handler decorators."""

    group: str
    version: str
    plural: str


def build_registry(
    reconciler: Reconciler, resync_seconds: float, child_types: tuple[ChildType, ...] = CHILD_TYPES
) -> kopf.OperatorRegistry:
    """A kopf registry with this operator's handlers (module doc), bound to ``reconciler``; no global registry.
    ``resync_seconds``: the timer's interval (also its initial delay: a new object was just reconciled)."""
    registry = kopf.OperatorRegistry()
    isvc = _ResourceSelector(group=constants.API_GROUP, version=constants.API_VERSION, plural=constants.CRD_PLURAL)

    kopf.on.login(registry=registry)(kopf.login_via_client)

    def on_change(body: kopf.Body, reason: str, logger: Any, **_: Any) -> None:
        reconciler.reconcile(body, str(reason), logger)

    for decorator in (kopf.on.create, kopf.on.update, kopf.on.resume):
        decorator(**isvc, id="reconcile", registry=registry)(on_change)

    def resync(body: kopf.Body, logger: Any, **_: Any) -> None:
        reconciler.reconcile(body, "timer", logger)

    kopf.timer(**isvc, id="resync", interval=resync_seconds, initial_delay=resync_seconds, registry=registry)(resync)

    def on_isvc_event(event: Mapping[str, Any], name: str, namespace: str | None, **_: Any) -> None:
        if event.get("type") == "DELETED":
            reconciler.forget(namespace or "", name)  # namespaced: never None (state is keyed by "" if it were)

    kopf.on.event(**isvc, id="forget", registry=registry)(on_isvc_event)

    def on_child(event: Mapping[str, Any], body: kopf.Body, logger: Any, **_: Any) -> None:
        reconciler.child_changed(event.get("type"), body, logger)

    for rtype in child_types:
        group, _, version = rtype.api_version.rpartition("/")
        kopf.on.event(
            group=group,
            version=version,
            plural=rtype.plural,
            id=f"child-{rtype.plural}",
            labels={constants.LABEL_INFERENCE_SERVICE: kopf.PRESENT},
            registry=registry,
        )(on_child)

    def on_endpoint_slice(event: Mapping[str, Any], body: kopf.Body, logger: Any, **_: Any) -> None:
        labels = (body.get("metadata") or {}).get("labels") or {}
        owner = labels.get(constants.LABEL_INFERENCE_SERVICE)
        if owner and labels.get(constants.LABEL_SERVICE_NAME) == constants.engine_deployment_name(owner):
            reconciler.child_changed(event.get("type"), body, logger)

    # The EndpointSlice controller copies a Service's labels onto its slices, so the engine Service's slices carry
    # the InferenceService label; the router Service's slices (same label) do not feed the status and are skipped.
    group, _, version = ENDPOINT_SLICES.api_version.rpartition("/")
    kopf.on.event(
        group=group,
        version=version,
        plural=ENDPOINT_SLICES.plural,
        id=f"child-{ENDPOINT_SLICES.plural}",
        labels={constants.LABEL_INFERENCE_SERVICE: kopf.PRESENT},
        registry=registry,
    )(on_endpoint_slice)
    return registry
