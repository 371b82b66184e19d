"""operator/status.py: an InferenceService's status from GIVEN Deployment / EndpointSlice objects, shaped as
kube-controller-manager writes them (each fixture validates against the real Kubernetes schema), since the API mock
has no controllers."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import kubernetes_validate
import pytest

from radixserve.contracts import constants
from radixserve.operator.render import RenderOptions, engine_selector, render_children
from radixserve.operator.spec import InferenceService, InferenceServiceStatus
from radixserve.operator.status import ApplyError, ObservedChildren, compute_status, invalid_spec_status

NS = "ml"
NAME = "llm"
NOW = datetime(2025, 5, 1, 10, 5, 0, tzinfo=UTC)
LATER = NOW + timedelta(minutes=3)
ENGINE_RS = f"{constants.engine_deployment_name(NAME)}-6c9f8d7b5d"
ROUTER_RS = f"{constants.router_deployment_name(NAME)}-5f7d9c8b4"


def make_isvc(replicas: int | None = 2, router_replicas: int = 1, generation: int = 1, **spec: Any) -> InferenceService:
    body = {
        "model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"},
        "router": {"replicas": router_replicas},
        **spec,
    }
    if replicas is not None:
        body["replicas"] = replicas
    return InferenceService.model_validate(
        {
            "metadata": {
                "name": NAME,
                "namespace": NS,
                "uid": "0d2c9a1e-8f5b-4d6f-9c1a-6e3b2a7f4d10",
                "generation": generation,
            },
            "spec": body,
        }
    )


def cond(type_: str, status: str, reason: str, message: str, at: str = "2025-05-01T10:00:00Z") -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": at,
        "lastUpdateTime": at,
    }


AVAILABLE = cond("Available", "True", "MinimumReplicasAvailable", "Deployment has minimum availability.")
UNAVAILABLE = cond("Available", "False", "MinimumReplicasUnavailable", "Deployment does not have minimum availability.")


def progressed(rs: str) -> dict:
    return cond("Progressing", "True", "NewReplicaSetAvailable", f'ReplicaSet "{rs}" has successfully progressed.')


def progressing(rs: str) -> dict:
    return cond("Progressing", "True", "ReplicaSetUpdated", f'ReplicaSet "{rs}" is progressing.')


def timed_out(rs: str) -> dict:
    return cond("Progressing", "False", "ProgressDeadlineExceeded", f'ReplicaSet "{rs}" has timed out progressing.')


def deployment(
    isvc: InferenceService, component: str, status: dict[str, Any], *, generation: int = 1, replicas: int | None = None
) -> dict[str, Any]:
    """The rendered Deployment as the API server returns it: generation set, the controller's status."""
    name = (
        constants.engine_deployment_name(NAME)
        if component == constants.COMPONENT_ENGINE
        else constants.router_deployment_name(NAME)
    )
    children = render_children(isvc, RenderOptions(image="radixserve:0.5.0"))
    (dep,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == name]
    dep = copy.deepcopy(dep)
    dep["metadata"].update(
        {
            "generation": generation,
            "resourceVersion": "4711",
            "creationTimestamp": "2025-05-01T10:00:00Z",
            "uid": "a1b2c3d4-0000-4000-8000-000000000001",
        }
    )
    if replicas is not None:
        dep["spec"]["replicas"] = replicas
    dep["status"] = status
    kubernetes_validate.validate(dep, "1.33.0", strict=True)
    return dep


def complete_status(n: int, rs: str, generation: int = 1) -> dict[str, Any]:
    if n == 0:  # the controller omits zero counts
        return {"observedGeneration": generation, "conditions": [AVAILABLE, progressed(rs)]}
    return {
        "observedGeneration": generation,
        "replicas": n,
        "updatedReplicas": n,
        "readyReplicas": n,
        "availableReplicas": n,
        "conditions": [AVAILABLE, progressed(rs)],
    }


def endpoint(ip: str, pod: str, *, ready: bool, terminating: bool = False) -> dict[str, Any]:
    return {
        "addresses": [ip],
        "conditions": {"ready": ready, "serving": ready or terminating, "terminating": terminating},
        "nodeName": "gpu-node-1",
        "zone": "europe-west4-a",
        "targetRef": {"kind": "Pod", "name": pod, "namespace": NS, "uid": f"uid-{pod}"},
    }


def endpoint_slice(endpoints: list[dict[str, Any]], suffix: str = "x7k2p") -> dict[str, Any]:
    svc = constants.engine_deployment_name(NAME)
    sl = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{svc}-{suffix}",
            "generateName": f"{svc}-",
            "namespace": NS,
            "labels": {
                constants.LABEL_SERVICE_NAME: svc,
                "service.kubernetes.io/headless": "",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                constants.LABEL_NAME: constants.LABEL_NAME_VALUE,
                constants.LABEL_COMPONENT: constants.COMPONENT_ENGINE,
                constants.LABEL_INFERENCE_SERVICE: NAME,
            },
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": svc,
                    "uid": "svc-uid",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": constants.HTTP_PORT_NAME, "port": constants.ENGINE_PORT, "protocol": "TCP"}],
    }
    kubernetes_validate.validate(sl, "1.33.0", strict=True)
    return sl


def healthy(isvc: InferenceService, engines: int = 2, routers: int = 1) -> ObservedChildren:
    return ObservedChildren(
        engine_deployment=deployment(isvc, constants.COMPONENT_ENGINE, complete_status(engines, ENGINE_RS)),
        router_deployment=deployment(isvc, constants.COMPONENT_ROUTER, complete_status(routers, ROUTER_RS)),
        endpoint_slices=[
            endpoint_slice([endpoint(f"10.244.1.{i + 10}", f"{ENGINE_RS}-p{i}", ready=True) for i in range(engines)])
        ],
    )


def conditions(status: dict) -> dict[str, dict]:
    InferenceServiceStatus.model_validate(status)  # the wire shape the CRD declares (reasons CamelCase)
    types = [c["type"] for c in status["conditions"]]
    assert types == ["Ready", "Progressing", "Degraded"]
    return {c["type"]: c for c in status["conditions"]}


def summary(status: dict) -> dict[str, tuple[str, str]]:
    return {t: (c["status"], c["reason"]) for t, c in conditions(status).items()}


# --- the happy path -------------------------------------------------------------------------------------------------


def test_all_ready() -> None:
    isvc = make_isvc(replicas=2, generation=3)
    status = compute_status(isvc, healthy(isvc), now=NOW)
    assert summary(status) == {
        "Ready": ("True", "Ready"),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert status["selector"] == engine_selector(NAME)
    assert status["url"] == f"http://{constants.router_service_name(NAME)}.{NS}.svc.cluster.local"
    assert status["modelName"] == constants.DEMO_MODEL_NAME
    assert all(c["lastTransitionTime"] == "2025-05-01T10:05:00Z" for c in status["conditions"])


# --- Ready ----------------------------------------------------------------------------------------------------------


def test_engines_loading_are_not_ready_and_progressing() -> None:
    isvc = make_isvc(replicas=2)
    observed = healthy(isvc)
    observed.engine_deployment = deployment(
        isvc,
        constants.COMPONENT_ENGINE,
        {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "unavailableReplicas": 2,
            "conditions": [UNAVAILABLE, progressing(ENGINE_RS)],
        },
    )
    observed.endpoint_slices = [
        endpoint_slice([endpoint("10.244.1.10", "p0", ready=False), endpoint("10.244.1.11", "p1", ready=False)])
    ]
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status) == {
        "Ready": ("False", "EnginesNotReady"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    assert (status["replicas"], status["readyReplicas"]) == (2, 0)
    assert "0 of 2" in conditions(status)["Ready"]["message"]


def test_ready_engines_without_ready_endpoints() -> None:
    """The Deployment counts a pod ready before the EndpointSlice controller has published it: not Ready yet."""
    isvc = make_isvc(replicas=1)
    observed = healthy(isvc, engines=1)
    observed.endpoint_slices = [
        endpoint_slice(
            [endpoint("10.244.1.10", "p0", ready=False), endpoint("10.244.1.12", "old", ready=False, terminating=True)]
        )
    ]
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status)["Ready"] == ("False", "EndpointsNotReady")
    assert constants.engine_deployment_name(NAME) in conditions(status)["Ready"]["message"]
    observed.endpoint_slices = []
    assert summary(compute_status(isvc, observed, now=NOW))["Ready"] == ("False", "EndpointsNotReady")
    # One ready endpoint in a second slice is enough.
    observed.endpoint_slices = [
        endpoint_slice([endpoint("10.244.1.10", "p0", ready=False)]),
        endpoint_slice([endpoint("10.244.1.13", "p1", ready=True)], suffix="b9d4q"),
    ]
    assert summary(compute_status(isvc, observed, now=NOW))["Ready"] == ("True", "Ready")


def test_terminating_endpoint_does_not_count() -> None:
    isvc = make_isvc(replicas=1)
    observed = healthy(isvc, engines=1)
    # Kubernetes marks a terminating pod's endpoint ready=false, serving=true, terminating=true.
    observed.endpoint_slices = [endpoint_slice([endpoint("10.244.1.10", "p0", ready=False, terminating=True)])]
    assert summary(compute_status(isvc, observed, now=NOW))["Ready"] == ("False", "EndpointsNotReady")
    # A nil ready means ready (the API says so; the router reads it the same way), unless terminating.
    unset = endpoint("10.244.1.11", "p1", ready=True)
    del unset["conditions"]["ready"]
    observed.endpoint_slices = [endpoint_slice([unset])]
    assert summary(compute_status(isvc, observed, now=NOW))["Ready"] == ("True", "Ready")
    unset["conditions"]["terminating"] = True
    observed.endpoint_slices = [endpoint_slice([unset])]
    assert summary(compute_status(isvc, observed, now=NOW))["Ready"] == ("False", "EndpointsNotReady")


def test_router_not_ready() -> None:
    isvc = make_isvc(replicas=1)
    observed = healthy(isvc, engines=1)
    observed.router_deployment = deployment(
        isvc,
        constants.COMPONENT_ROUTER,
        {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "unavailableReplicas": 1,
            "conditions": [UNAVAILABLE, progressing(ROUTER_RS)],
        },
    )
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status)["Ready"] == ("False", "RouterNotReady")
    assert summary(status)["Progressing"] == ("True", "RollingOut")
    assert status["readyReplicas"] == 1  # engine counts: the router's are not the scale subresource's


def test_scaled_to_zero() -> None:
    isvc = make_isvc(replicas=0)
    observed = healthy(isvc, engines=0)
    observed.endpoint_slices = [endpoint_slice([])]
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status) == {
        "Ready": ("False", "ScaledToZero"),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert (status["replicas"], status["readyReplicas"]) == (0, 0)


def test_router_scaled_to_zero_is_not_ready() -> None:
    isvc = make_isvc(replicas=1, router_replicas=0)
    status = compute_status(isvc, healthy(isvc, engines=1, routers=0), now=NOW)
    assert summary(status)["Ready"] == ("False", "ScaledToZero")
    assert "router" in conditions(status)["Ready"]["message"]
    assert summary(status)["Degraded"] == ("False", "AsExpected")


# --- Progressing ----------------------------------------------------------------------------------------------------


def test_generation_not_yet_observed_is_reconciling() -> None:
    isvc = make_isvc(replicas=2)
    observed = healthy(isvc)
    observed.engine_deployment = deployment(
        isvc, constants.COMPONENT_ENGINE, complete_status(2, ENGINE_RS), generation=2
    )
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status)["Progressing"] == ("True", "Reconciling")
    assert summary(status)["Ready"] == ("True", "Ready")  # the old pods still serve


def test_deployment_replicas_behind_the_spec_is_reconciling() -> None:
    """spec.replicas changed (kubectl scale / the HPA) but the Deployment was not patched yet."""
    isvc = make_isvc(replicas=4)
    observed = healthy(isvc)
    observed.engine_deployment = deployment(isvc, constants.COMPONENT_ENGINE, complete_status(2, ENGINE_RS), replicas=2)
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status)["Progressing"] == ("True", "Reconciling")
    assert "4 wanted" in conditions(status)["Progressing"]["message"]


def test_rolling_update_with_old_replicas() -> None:
    isvc = make_isvc(replicas=2)
    observed = healthy(isvc)
    # maxSurge 1, maxUnavailable 0: one new pod starting next to two old ready ones.
    observed.engine_deployment = deployment(
        isvc,
        constants.COMPONENT_ENGINE,
        {
            "observedGeneration": 1,
            "replicas": 3,
            "updatedReplicas": 1,
            "readyReplicas": 2,
            "availableReplicas": 2,
            "unavailableReplicas": 1,
            "conditions": [AVAILABLE, progressing(ENGINE_RS)],
        },
    )
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status) == {
        "Ready": ("True", "Ready"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    assert "1 of 2 updated" in conditions(status)["Progressing"]["message"]
    assert status["replicas"] == 3
    # All updated, one old pod still terminating.
    observed.engine_deployment = deployment(
        isvc,
        constants.COMPONENT_ENGINE,
        {
            "observedGeneration": 1,
            "replicas": 3,
            "updatedReplicas": 2,
            "readyReplicas": 3,
            "availableReplicas": 3,
            "conditions": [AVAILABLE, progressing(ENGINE_RS)],
        },
    )
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status)["Progressing"] == ("True", "RollingOut")
    assert "old replicas" in conditions(status)["Progressing"]["message"]


# --- Degraded -------------------------------------------------------------------------------------------------------


def test_progress_deadline_exceeded_is_degraded() -> None:
    isvc = make_isvc(replicas=2)
    observed = healthy(isvc)
    observed.engine_deployment = deployment(
        isvc,
        constants.COMPONENT_ENGINE,
        {
            "observedGeneration": 1,
            "replicas": 3,
            "updatedReplicas": 1,
            "readyReplicas": 2,
            "availableReplicas": 2,
            "unavailableReplicas": 1,
            "conditions": [AVAILABLE, timed_out(ENGINE_RS)],
        },
    )
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status) == {
        "Ready": ("True", "Ready"),
        "Progressing": ("False", "ProgressDeadlineExceeded"),
        "Degraded": ("True", "ProgressDeadlineExceeded"),
    }
    assert "has timed out progressing" in conditions(status)["Degraded"]["message"]
    assert constants.engine_deployment_name(NAME) in conditions(status)["Degraded"]["message"]


def test_replica_failure_is_degraded() -> None:
    isvc = make_isvc(replicas=3)
    observed = healthy(isvc)
    quota = (
        'pods "llm-engine-6c9f8d7b5d-abcde" is forbidden: exceeded quota: gpu, requested: '
        "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=2, limited: requests.nvidia.com/gpu=2"
    )
    observed.engine_deployment = deployment(
        isvc,
        constants.COMPONENT_ENGINE,
        {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "readyReplicas": 2,
            "availableReplicas": 2,
            "unavailableReplicas": 1,
            "conditions": [AVAILABLE, progressing(ENGINE_RS), cond("ReplicaFailure", "True", "FailedCreate", quota)],
        },
    )
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status)["Degraded"] == ("True", "ReplicaFailure")
    assert "exceeded quota" in conditions(status)["Degraded"]["message"]
    assert summary(status)["Progressing"] == ("True", "RollingOut")


def test_children_missing() -> None:
    isvc = make_isvc(replicas=1)
    observed = healthy(isvc, engines=1)
    observed.router_deployment = None
    observed.missing = [f"Service/{constants.router_service_name(NAME)}"]
    status = compute_status(isvc, observed, now=NOW)
    assert summary(status) == {
        "Ready": ("False", "ChildrenMissing"),
        "Progressing": ("True", "Reconciling"),
        "Degraded": ("True", "ChildrenMissing"),
    }
    message = conditions(status)["Degraded"]["message"]
    assert f"Service/{constants.router_service_name(NAME)}" in message
    assert f"Deployment/{constants.router_deployment_name(NAME)}" in message
    # Nothing at all yet (just created): counts are 0, still a valid status.
    status = compute_status(isvc, ObservedChildren(missing=["ConfigMap/llm-config"]), now=NOW)
    assert (status["replicas"], status["readyReplicas"]) == (0, 0)
    assert summary(status)["Ready"] == ("False", "ChildrenMissing")


def test_several_problems_are_all_reported() -> None:
    isvc = make_isvc(replicas=1)
    observed = healthy(isvc, engines=1)
    observed.missing = ["PodDisruptionBudget/llm-engine"]
    observed.router_deployment = deployment(
        isvc,
        constants.COMPONENT_ROUTER,
        {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "unavailableReplicas": 1,
            "conditions": [UNAVAILABLE, timed_out(ROUTER_RS)],
        },
    )
    degraded = conditions(compute_status(isvc, observed, now=NOW))["Degraded"]
    assert degraded["status"] == "True"
    assert "PodDisruptionBudget/llm-engine" in degraded["message"] and "timed out" in degraded["message"]


@pytest.mark.parametrize("reason", ["ChildConflict", "Forbidden", "ApplyRejected", "ApplyFailed"])
def test_a_refused_apply_is_degraded_and_not_ready_even_with_healthy_pods(reason: str) -> None:
    """Regression: a refused child write left the status as it was (a stale Ready=True for a spec not applied)."""
    isvc = make_isvc(replicas=2, generation=4)
    before = compute_status(isvc, healthy(isvc), now=NOW)
    assert summary(before)["Ready"] == ("True", "Ready")
    observed = healthy(isvc)
    message = f"patch ConfigMap/{NAME}-config: HTTP 422 Invalid: data: Too long"
    observed.apply_error = ApplyError(reason, message)
    status = compute_status(isvc, observed, now=LATER, previous_conditions=before["conditions"])
    assert summary(status) == {
        "Ready": ("False", reason),
        "Progressing": ("False", reason),
        "Degraded": ("True", reason),
    }
    assert conditions(status)["Degraded"]["message"] == message
    assert status["observedGeneration"] == 4 and all(c["observedGeneration"] == 4 for c in status["conditions"])
    assert conditions(status)["Ready"]["lastTransitionTime"] == "2025-05-01T10:08:00Z"
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)  # what runs is still reported
    # Children the refused apply did not create are not reported as a second problem.
    observed.router_deployment = None
    degraded = conditions(compute_status(isvc, observed, now=LATER))["Degraded"]
    assert degraded["reason"] == reason and degraded["message"] == message


# --- transitions ----------------------------------------------------------------------------------------------------


def test_last_transition_time_changes_only_on_a_flip() -> None:
    isvc = make_isvc(replicas=1)
    loading = healthy(isvc, engines=1)
    loading.endpoint_slices = [endpoint_slice([endpoint("10.244.1.10", "p0", ready=False)])]
    first = compute_status(isvc, loading, now=NOW)
    assert conditions(first)["Ready"]["lastTransitionTime"] == "2025-05-01T10:05:00Z"
    # Same statuses later (a reason or message may change): times kept.
    again = compute_status(isvc, loading, now=LATER, previous_conditions=first["conditions"])
    assert [c["lastTransitionTime"] for c in again["conditions"]] == [
        c["lastTransitionTime"] for c in first["conditions"]
    ]
    # Ready flips: its time moves; Degraded stays False: its time stays.
    ready = compute_status(isvc, healthy(isvc, engines=1), now=LATER, previous_conditions=again["conditions"])
    assert conditions(ready)["Ready"]["status"] == "True"
    assert conditions(ready)["Ready"]["lastTransitionTime"] == "2025-05-01T10:08:00Z"
    assert conditions(ready)["Degraded"]["lastTransitionTime"] == "2025-05-01T10:05:00Z"


def test_naive_now_is_utc_and_other_zones_are_converted() -> None:
    isvc = make_isvc(replicas=1)
    naive = compute_status(isvc, healthy(isvc, engines=1), now=datetime(2025, 5, 1, 10, 5, 0))
    cet = compute_status(
        isvc, healthy(isvc, engines=1), now=datetime(2025, 5, 1, 12, 5, 0, tzinfo=timezone(timedelta(hours=2)))
    )
    assert naive["conditions"] == cet["conditions"]
    assert naive["conditions"][0]["lastTransitionTime"] == "2025-05-01T10:05:00Z"


# --- invalid spec ---------------------------------------------------------------------------------------------------


def test_invalid_spec_status() -> None:
    message = "spec.autoscaling: autoscaling.minReplicas (5) must be <= maxReplicas (2)"
    status = invalid_spec_status(NAME, NS, 4, message, now=NOW)
    assert summary(status) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert conditions(status)["Degraded"]["message"] == message
    assert status["observedGeneration"] == 4
    assert "replicas" not in status and "readyReplicas" not in status  # not the operator's to claim
    assert "modelName" not in status
    assert status["selector"] == engine_selector(NAME)
    assert status["url"] == f"http://{constants.router_service_name(NAME)}.{NS}.svc.cluster.local"
    # Was Ready before: Ready flips (new time); still Degraded/InvalidSpec later: time kept.
    before = compute_status(make_isvc(replicas=1), healthy(make_isvc(replicas=1), engines=1), now=NOW)
    broken = invalid_spec_status(NAME, NS, 5, message, now=LATER, previous_conditions=before["conditions"])
    assert conditions(broken)["Ready"]["lastTransitionTime"] == "2025-05-01T10:08:00Z"
    assert conditions(broken)["Progressing"]["lastTransitionTime"] == "2025-05-01T10:05:00Z"  # False -> False
    still = invalid_spec_status(
        NAME, NS, 6, "other", now=LATER + timedelta(hours=1), previous_conditions=broken["conditions"]
    )
    assert conditions(still)["Degraded"]["lastTransitionTime"] == "2025-05-01T10:08:00Z"
    assert conditions(still)["Degraded"]["message"] == "other"


def test_invalid_spec_status_without_generation() -> None:
    status = invalid_spec_status(NAME, NS, None, "bad", now=NOW)
    assert "observedGeneration" not in status
    assert all("observedGeneration" not in c for c in conditions(status).values())
