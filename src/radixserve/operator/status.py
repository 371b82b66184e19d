"""An InferenceService's status from its observed children: a pure function (no API calls; the clock is passed in).

Conditions follow metav1.Condition (type, status, reason, message, lastTransitionTime, observedGeneration);
``lastTransitionTime`` changes only when a condition's status flips, so the previous conditions are passed in.

- **Ready** True when the engine Deployment has >= 1 ready replica, the engine Service's EndpointSlices list >= 1
  ready endpoint (what the router routes to) and the router Deployment has >= 1 ready replica. Reasons: ``Ready``,
  ``ChildrenMissing``, ``ScaledToZero`` (engine replicas 0, or router replicas 0: allowed by the API, but then
  ``status.url`` serves nothing, so the service is not Ready), ``EnginesNotReady``, ``EndpointsNotReady``,
  ``RouterNotReady``, ``InvalidSpec``.
- **Progressing** True while a rollout is under way: children missing or a Deployment's controller has not yet seen
  its latest generation or spec (``Reconciling``); fewer updated replicas than desired, old replicas still present,
  or fewer ready/available than desired (``RollingOut``). False with ``Complete`` when both Deployments are done,
  ``ProgressDeadlineExceeded`` when the Deployment controller gave up, ``InvalidSpec`` for an invalid spec. The
  rollout checks follow ``kubectl rollout status`` (kubectl/pkg/polymorphichelpers/rollout_status.go).
- **Degraded** True on a Deployment's ``ProgressDeadlineExceeded`` or ``ReplicaFailure`` condition, on children
  missing after apply (``ChildrenMissing``), or an invalid spec (``InvalidSpec``, the message says what is wrong);
  else False with ``AsExpected``.
- A change the API server refused (``ObservedChildren.apply_error``: a child name taken by a foreign object, a 403,
  a 422, ...) puts its reason (``ChildConflict``, ``Forbidden``, ``ApplyRejected``) on all three: Degraded True with
  the message naming ``Kind/name`` and the server's answer, Ready False (whatever the pods do, the spec in force is
  not the one asked for) and Progressing False (nothing moves until it is resolved). A write that kept failing
  with 429/5xx/connection errors (``ApplyFailed``; ``APIUnavailable`` when even reading the children failed) is
  reported the same way, for the same reason: Ready False, since the spec asked for is not (or only partly) in
  force, even if the pods of the previous one still serve. The operator retries it; the next successful reconcile
  clears all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from radixserve.contracts import constants
from radixserve.contracts.endpointslice import serving_address
from radixserve.operator.render import engine_selector
from radixserve.operator.spec import InferenceService

__all__ = [
    "ObservedChildren",
    "ApplyError",
    "compute_status",
    "invalid_spec_status",
    "service_url",
    "ready_endpoint_count",
    "format_time",
]


@dataclass(frozen=True)
class ApplyError:
    """Why the desired children could not be applied: ``reason`` a CamelCase condition reason (``ChildConflict``,
    ``Forbidden``, ``ApplyRejected``; ``ApplyFailed`` or ``APIUnavailable`` for errors still retried), ``message``
    naming the child (``Kind/name``) and the API server's answer."""

    reason: str
    message: str


@dataclass
class ObservedChildren:
    """What the handlers read back from the API server after applying the desired children (or, when
    ``apply_error`` is set, what was live when the apply was refused)."""

    engine_deployment: dict[str, Any] | None = None
    router_deployment: dict[str, Any] | None = None
    endpoint_slices: list[dict[str, Any]] = field(default_factory=list)  # slices of the engine Service
    missing: list[str] = field(default_factory=list)  # "Kind/name" of desired children not found
    apply_error: ApplyError | None = None


def service_url(name: str, namespace: str) -> str:
    """``status.url``: the router Service's in-cluster address (port ROUTER_SERVICE_PORT, 80, so no port)."""
    return f"http://{constants.router_service_name(name)}.{namespace}.svc.cluster.local"


def format_time(now: datetime) -> str:
    """RFC 3339 in UTC with second precision, as metav1.Time serialises (a naive datetime is taken as UTC)."""
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_endpoint_count(slices: list[dict[str, Any]]) -> int:
    """Distinct addresses of ready, non-terminating endpoints in ``slices`` (discovery.k8s.io/v1 dicts). A nil
    ``conditions.ready`` counts as ready (the API says so): ``serving_address``, the rule the router applies too."""
    addresses = {serving_address(ep) for obj in slices for ep in obj.get("endpoints") or []}
    return len(addresses - {None})


def _condition(type_: str, status: bool | str, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    value = status if isinstance(status, str) else ("True" if status else "False")
    cond: dict[str, Any] = {"type": type_, "status": value, "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _stamp(
    conditions: list[dict[str, Any]], previous: list[dict[str, Any]] | None, now: datetime
) -> list[dict[str, Any]]:
    """Set lastTransitionTime: the previous one when the condition's status did not change, else ``now``."""
    before = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    stamp = format_time(now)
    for cond in conditions:
        old = before.get(cond["type"])
        if old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime"):
            cond["lastTransitionTime"] = old["lastTransitionTime"]
        else:
            cond["lastTransitionTime"] = stamp
    return conditions


def _int(obj: dict[str, Any] | None, *path: str) -> int:
    cur: Any = obj
    for key in path:
        cur = (cur or {}).get(key) if isinstance(cur, dict) else None
    return int(cur) if isinstance(cur, (int, float)) else 0


def _deployment_condition(dep: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    cond: dict[str, Any]
    for cond in ((dep or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


@dataclass(frozen=True)
class _Rollout:
    """One Deployment's rollout state (kubectl rollout status logic)."""

    state: str  # "reconciling" | "rolling" | "complete" | "failed"
    message: str


def _rollout(dep: dict[str, Any], what: str, desired: int | None) -> _Rollout:
    meta = dep.get("metadata") or {}
    name = meta.get("name", what)
    generation = meta.get("generation")
    spec_replicas = _int(dep, "spec", "replicas") if (dep.get("spec") or {}).get("replicas") is not None else 1
    observed = (dep.get("status") or {}).get("observedGeneration")
    if generation is not None and (observed is None or observed < generation):
        return _Rollout("reconciling", f"waiting for Deployment {name} (generation {generation}) to be observed")
    if desired is not None and spec_replicas != desired:
        return _Rollout("reconciling", f"Deployment {name} has {spec_replicas} replicas, {desired} wanted")
    progressing = _deployment_condition(dep, "Progressing")
    if progressing and progressing.get("reason") == "ProgressDeadlineExceeded":
        return _Rollout("failed", f"Deployment {name}: {progressing.get('message') or 'progress deadline exceeded'}")
    updated = _int(dep, "status", "updatedReplicas")
    replicas = _int(dep, "status", "replicas")
    available = _int(dep, "status", "availableReplicas")
    ready = _int(dep, "status", "readyReplicas")
    if updated < spec_replicas:
        return _Rollout("rolling", f"{what}: {updated} of {spec_replicas} updated replicas")
    if replicas > updated:
        return _Rollout("rolling", f"{what}: {replicas - updated} old replicas pending termination")
    if available < updated or ready < spec_replicas:
        return _Rollout("rolling", f"{what}: {min(available, ready)} of {spec_replicas} updated replicas available")
    return _Rollout("complete", f"{what}: {spec_replicas} replicas up to date")


def compute_status(
    isvc: InferenceService,
    observed: ObservedChildren,
    *,
    now: datetime,
    previous_conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The wire status (camelCase) of ``isvc`` from its observed children: observedGeneration, replicas and
    readyReplicas (of the engine Deployment; the scale subresource reads them), selector, url, modelName and the
    Ready / Progressing / Degraded conditions (module docstring). ``now`` stamps conditions whose status flipped."""
    name = isvc.metadata.name
    namespace = isvc.metadata.namespace or "default"
    generation = isvc.metadata.generation
    engine, router = observed.engine_deployment, observed.router_deployment
    desired = isvc.spec.desired_replicas()
    router_desired = isvc.spec.router.replicas
    engine_ready = _int(engine, "status", "readyReplicas")
    router_ready = _int(router, "status", "readyReplicas")
    endpoints = ready_endpoint_count(observed.endpoint_slices)
    missing = sorted(set(observed.missing))
    if engine is None and f"Deployment/{constants.engine_deployment_name(name)}" not in missing:
        missing.append(f"Deployment/{constants.engine_deployment_name(name)}")
    if router is None and f"Deployment/{constants.router_deployment_name(name)}" not in missing:
        missing.append(f"Deployment/{constants.router_deployment_name(name)}")
    missing_msg = "missing: " + ", ".join(missing) if missing else ""

    # Ready
    engine_svc = constants.engine_deployment_name(name)
    refused = observed.apply_error
    if refused is not None:
        ready = _condition(
            "Ready", False, refused.reason, "the spec is not (fully) applied; see the Degraded condition", generation
        )
    elif missing:
        ready = _condition("Ready", False, "ChildrenMissing", missing_msg, generation)
    elif desired == 0:
        ready = _condition("Ready", False, "ScaledToZero", "engine replicas is 0", generation)
    elif router_desired == 0:
        ready = _condition(
            "Ready",
            False,
            "ScaledToZero",
            f"router replicas is 0: nothing serves {service_url(name, namespace)}",
            generation,
        )
    elif engine_ready < 1:
        ready = _condition("Ready", False, "EnginesNotReady", f"0 of {desired} engine pods ready", generation)
    elif endpoints < 1:
        ready = _condition(
            "Ready",
            False,
            "EndpointsNotReady",
            f"{engine_ready} engine pods ready but no ready endpoint in the EndpointSlices of "
            f"Service {engine_svc} yet (the router cannot see them)",
            generation,
        )
    elif router_ready < 1:
        ready = _condition("Ready", False, "RouterNotReady", f"0 of {router_desired} router pods ready", generation)
    else:
        ready = _condition(
            "Ready",
            True,
            "Ready",
            f"{engine_ready} of {desired} engines ready ({endpoints} routable), "
            f"{router_ready} of {router_desired} routers ready",
            generation,
        )

    # Progressing / Degraded
    rollouts = []
    if engine is not None:
        rollouts.append(_rollout(engine, "engines", desired))
    if router is not None:
        rollouts.append(_rollout(router, "routers", router_desired))
    problems: list[tuple[str, str]] = []  # (reason, message) for Degraded
    if refused is not None:
        problems.append((refused.reason, refused.message))
    if missing and refused is None:  # children a refused apply did not create are no separate problem
        problems.append(("ChildrenMissing", missing_msg))
    for dep in (engine, router):
        if dep is None:  # absent: no conditions to read (reported as missing above)
            continue
        progress = _deployment_condition(dep, "Progressing")
        if progress and progress.get("reason") == "ProgressDeadlineExceeded":
            problems.append(
                (
                    "ProgressDeadlineExceeded",
                    f"Deployment {(dep.get('metadata') or {}).get('name')}: "
                    f"{progress.get('message') or 'progress deadline exceeded'}",
                )
            )
        failure = _deployment_condition(dep, "ReplicaFailure")
        if failure and failure.get("status") == "True":
            problems.append(
                (
                    "ReplicaFailure",
                    f"Deployment {(dep.get('metadata') or {}).get('name')}: "
                    f"{failure.get('message') or failure.get('reason') or 'replica failure'}",
                )
            )
    failed = [r for r in rollouts if r.state == "failed"]
    pending = [r for r in rollouts if r.state in ("reconciling", "rolling")]
    if refused is not None:
        progressing = _condition(
            "Progressing",
            False,
            refused.reason,
            "nothing more is applied until this is resolved; see the Degraded condition",
            generation,
        )
    elif failed:
        progressing = _condition(
            "Progressing", False, "ProgressDeadlineExceeded", "; ".join(r.message for r in failed), generation
        )
    elif missing or any(r.state == "reconciling" for r in rollouts):
        msgs = ([missing_msg] if missing else []) + [r.message for r in pending]
        progressing = _condition("Progressing", True, "Reconciling", "; ".join(msgs), generation)
    elif pending:
        progressing = _condition("Progressing", True, "RollingOut", "; ".join(r.message for r in pending), generation)
    else:
        progressing = _condition("Progressing", False, "Complete", "; ".join(r.message for r in rollouts), generation)
    if problems:
        degraded = _condition("Degraded", True, problems[0][0], "; ".join(m for _, m in problems), generation)
    else:
        degraded = _condition("Degraded", False, "AsExpected", "", generation)

    status: dict[str, Any] = {
        "replicas": _int(engine, "status", "replicas"),
        "readyReplicas": engine_ready,
        "selector": engine_selector(name),
        "url": service_url(name, namespace),
        "modelName": isvc.spec.served_model_name(name),
        "conditions": _stamp([ready, progressing, degraded], previous_conditions, now),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def invalid_spec_status(
    name: str,
    namespace: str,
    generation: int | None,
    message: str,
    *,
    now: datetime,
    previous_conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The status of an InferenceService whose spec cannot be parsed or rendered (nothing is applied): Ready False,
    Progressing False and Degraded True, all with reason ``InvalidSpec``; Degraded's message is ``message`` (what is
    wrong). Set besides: observedGeneration, and selector and url (they follow from name and namespace alone, so
    ``kubectl get`` and the scale subresource keep them); not replicas, readyReplicas or modelName, which only a
    valid spec and its children tell."""
    conditions = [
        _condition("Ready", False, "InvalidSpec", "the spec is invalid; see the Degraded condition", generation),
        _condition("Progressing", False, "InvalidSpec", "nothing applied until the spec is fixed", generation),
        _condition("Degraded", True, "InvalidSpec", message, generation),
    ]
    status: dict[str, Any] = {
        "selector": engine_selector(name),
        "url": service_url(name, namespace or "default"),
        "conditions": _stamp(conditions, previous_conditions, now),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status
