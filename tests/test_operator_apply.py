"""operator/apply.py: quantities, the zero-value-aware diff, the plan, and two-phase apply (dry run first) against
the API server emulator (tests/k8s_emulator.py), including the errors a real server gives (409 with a foreign
object, 403, 422, 5xx) injected with ``emulator.fail``."""

from __future__ import annotations

import asyncio
import copy
from decimal import Decimal
from typing import Any

import kopf
import pytest

from radixserve.contracts import constants
from radixserve.operator.apply import (
    LAST_APPLIED_ANNOTATION,
    ApplyRejected,
    KubeApi,
    RetryPolicy,
    apply,
    execute,
    is_empty,
    last_applied_record,
    merge_patch_for,
    plan,
    quantity,
    subset_equal,
)
from radixserve.operator.render import CHILD_TYPES, RenderOptions, render_children
from radixserve.operator.spec import InferenceService

from k8s_emulator import K8sEmulator, k8s, strip_empty  # noqa: F401 - pytest fixture

NS = "ml"
DEPLOYMENTS = next(t for t in CHILD_TYPES if t.kind == "Deployment")
CONFIGMAPS = next(t for t in CHILD_TYPES if t.kind == "ConfigMap")
OWNER_UID = "0d2c9a1e-8f5b-4d6f-9c1a-6e3b2a7f4d10"
FAST = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.02, handler_delay_s=1.0)


# --- quantities ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("1n", "1e-9"),
        ("1u", "1e-6"),
        ("1m", "0.001"),
        ("1", "1"),
        ("1k", "1000"),
        ("1M", "1e6"),
        ("1G", "1e9"),
        ("1T", "1e12"),
        ("1P", "1e15"),
        ("1E", "1e18"),
        ("1Ki", 2**10),
        ("1Mi", 2**20),
        ("1Gi", 2**30),
        ("1Ti", 2**40),
        ("1Pi", 2**50),
        ("1Ei", 2**60),
        ("1e3", "1000"),
        ("1E3", "1000"),
        ("2e-3", "0.002"),
        ("1.5", "1.5"),
        ("0.5Gi", 2**29),
        ("500m", "0.5"),
        (".5", "0.5"),
        ("+2", "2"),
        ("-1", "-1"),
        ("1.5E", "1.5e18"),
        (3, "3"),
        (0.25, "0.25"),
    ],
)
def test_quantity_parses_every_suffix_and_exponent(text, value):
    assert quantity(text) == Decimal(value)


@pytest.mark.parametrize("text", ["1e", "1Z", "1ki", "", "abc", "1.2.3", "Gi", "1 Gi", True, None, [1]])
def test_quantity_rejects_what_is_not_one(text):
    assert quantity(text) is None


def test_exa_quantity_compares_by_value_in_a_diff():
    """Regression: quantity("1E") raised ValueError (E taken as an exponent), so any diff with an exa value broke."""
    assert subset_equal({"limits": {"memory": "1E"}}, {"limits": {"memory": "1000P"}})
    assert not subset_equal({"limits": {"memory": "1E"}}, {"limits": {"memory": "1Ei"}})


# --- zero values a real API server omits ------------------------------------------------------------------------


def test_empty_values_equal_absent_fields_but_zero_does_not():
    assert is_empty(False) and is_empty("") and is_empty([]) and is_empty({}) and is_empty({"a": "", "b": []})
    assert not is_empty(0) and not is_empty({"a": 0}) and not is_empty([""])
    assert subset_equal({"key": "gpu", "operator": "Equal", "value": ""}, {"key": "gpu", "operator": "Equal"})
    assert subset_equal({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}, {})
    assert subset_equal({"spec": {"paused": False}}, {"spec": {}})
    assert not subset_equal({"spec": {"replicas": 0}}, {"spec": {}})  # replicas 0 is never omitted
    assert not subset_equal({"value": "x"}, {})


def _isvc(**spec: Any) -> InferenceService:
    return InferenceService.model_validate(
        {
            "metadata": {"name": "demo", "namespace": NS, "uid": OWNER_UID, "generation": 1},
            "spec": {"model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"}, **spec},
        }
    )


ZERO_VALUE_PLACEMENT = {
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [],
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]
            },
        }
    },
}


def test_children_as_a_real_server_returns_them_are_not_drift():
    """Regression (patch storm): a toleration with value "" and an empty preferred-affinity list come back from a
    real API server without those fields; every resync patched the engine Deployment again."""
    children = render_children(_isvc(placement=ZERO_VALUE_PLACEMENT), RenderOptions("radixserve:test"))
    engine = next(c for c in children if c["kind"] == "Deployment")
    assert engine["spec"]["template"]["spec"]["tolerations"][0]["value"] == ""  # the input really has them
    for child in children:
        live = strip_empty(_as_live(child))
        assert merge_patch_for(child, live) == {}, child["kind"]


def test_a_real_change_next_to_omitted_zero_values_is_still_patched():
    child = next(
        c
        for c in render_children(_isvc(placement=ZERO_VALUE_PLACEMENT), RenderOptions("radixserve:test"))
        if c["kind"] == "Deployment"
    )
    live = strip_empty(copy.deepcopy(child))
    live["spec"]["replicas"] = 0  # scaled to zero by hand: 0 is kept by the server and differs from 1
    assert merge_patch_for(child, live)["spec"] == {"replicas": 1}


# --- lists that admission or the server extends -------------------------------------------------------------------

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
POOL_TOLERATION = {"key": "pool", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}


def _engine(**placement: Any) -> dict[str, Any]:
    return next(
        c
        for c in render_children(_isvc(placement=placement), RenderOptions("radixserve:test"))
        if c["kind"] == "Deployment"
    )


def test_list_elements_admission_adds_are_not_drift():
    """Regression (patch storm): a mutating policy appending a toleration or an imagePullSecret to the pod template
    made the lists differ in length, so every resync dry-ran and patched the engine Deployment."""
    desired = _engine(tolerations=[GPU_TOLERATION])
    live = _as_live(desired)
    pod = live["spec"]["template"]["spec"]
    pod["tolerations"] = [
        POOL_TOLERATION,
        GPU_TOLERATION,
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "tolerationSeconds": 300},
    ]
    pod["imagePullSecrets"] = [{"name": "registry-mirror"}]
    pod["containers"][0].setdefault("env", []).append({"name": "INJECTED", "value": "1"})
    assert merge_patch_for(desired, live) == {}
    # Order is kept: the desired elements must appear in the live list in their order.
    assert subset_equal([1, 2], [0, 1, 5, 2]) and not subset_equal([1, 2], [2, 1]) and not subset_equal([1, 1], [1])
    # A desired element missing from the live list (removed by hand) is drift: the list is put back.
    pod["tolerations"] = [POOL_TOLERATION]
    assert merge_patch_for(desired, live)["spec"]["template"]["spec"]["tolerations"] == [GPU_TOLERATION]


def test_an_element_the_user_removed_from_the_spec_is_removed_from_the_live_list():
    before = _engine(tolerations=[GPU_TOLERATION, {"key": "spot", "operator": "Exists"}])
    live = _as_live(before)
    live["spec"]["template"]["spec"]["tolerations"].append(POOL_TOLERATION)  # admission's
    after = _engine(tolerations=[GPU_TOLERATION])
    # Still an in-order subsequence of the live list, but it differs from the last-applied record: replaced.
    patch = merge_patch_for(after, live)
    assert patch["spec"]["template"]["spec"]["tolerations"] == [GPU_TOLERATION]


# --- plan -------------------------------------------------------------------------------------------------------


def _desired(name: str = "demo-config", **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {constants.LABEL_INFERENCE_SERVICE: "demo"},
            "ownerReferences": [
                {
                    "apiVersion": "radixserve.io/v1alpha1",
                    "kind": "InferenceService",
                    "name": "demo",
                    "uid": OWNER_UID,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "data": data or {"config.json": "{}"},
    }


def _as_live(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as stored by an earlier apply."""
    live = copy.deepcopy(obj)
    live["metadata"].update(
        uid="x", resourceVersion="3", annotations={LAST_APPLIED_ANNOTATION: last_applied_record(obj)}
    )
    return live


def test_plan_creates_patches_keeps_and_deletes_only_what_it_owns():
    kept, changed = _desired("kept"), _desired("changed", a="1")
    stale = _as_live(_desired("stale"))
    foreign = _as_live(_desired("foreign"))
    foreign["metadata"]["ownerReferences"] = []
    live = [_as_live(kept), _as_live(_desired("changed", a="0")), stale, foreign]
    changes = plan(CONFIGMAPS, [kept, changed, _desired("new")], live, OWNER_UID)
    assert [(c.action, c.name) for c in changes] == [
        ("unchanged", "kept"),
        ("patch", "changed"),
        ("create", "new"),
        ("delete", "stale"),
    ]


def test_plan_refuses_a_desired_name_taken_by_an_object_it_does_not_control():
    foreign = _as_live(_desired())
    foreign["metadata"].pop("ownerReferences")
    with pytest.raises(ApplyRejected) as info:
        plan(CONFIGMAPS, [_desired()], [foreign], OWNER_UID)
    assert info.value.reason == "ChildConflict" and info.value.http_status == 409
    assert "ConfigMap/demo-config" in str(info.value) and "not controlled by this InferenceService" in str(info.value)


# --- against the emulator -----------------------------------------------------------------------------------------


async def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The kubernetes client blocks; the emulator runs on this loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@pytest.mark.asyncio
async def test_dry_run_writes_are_answered_but_store_nothing_and_emit_no_event(k8s):  # noqa: F811
    emulator, client = k8s
    api = KubeApi(client, FAST)
    rv = emulator.resource_version
    answer = await _in_thread(api.create, CONFIGMAPS, NS, _desired(), dry_run=True)
    assert answer["metadata"]["name"] == "demo-config" and answer["metadata"]["uid"]
    assert await _in_thread(api.get, CONFIGMAPS, NS, "demo-config") is None
    assert emulator.resource_version == rv and not emulator._events

    stored = await _in_thread(api.create, CONFIGMAPS, NS, _desired())
    rv = emulator.resource_version
    patched = await _in_thread(api.merge_patch, CONFIGMAPS, NS, "demo-config", {"data": {"x": "1"}}, dry_run=True)
    assert patched["data"]["x"] == "1"
    await _in_thread(api.delete, CONFIGMAPS, NS, "demo-config", dry_run=True)
    assert await _in_thread(api.get, CONFIGMAPS, NS, "demo-config") == stored
    assert emulator.resource_version == rv
    # A dry run still fails as the write would: a name taken, a patch of something absent.
    with pytest.raises(Exception) as info:
        await _in_thread(api.create, CONFIGMAPS, NS, _desired(), dry_run=True)
    assert getattr(info.value, "status", None) == 409


@pytest.mark.asyncio
async def test_omit_empty_emulator_serialises_builtin_objects_as_a_real_server(k8s):  # noqa: F811
    emulator, client = k8s
    emulator.omit_empty = True
    api = KubeApi(client, FAST)
    body = _desired(empty="")
    body["metadata"]["labels"]["blank"] = ""
    body["immutable"] = False
    stored = await _in_thread(api.create, CONFIGMAPS, NS, body)
    assert "immutable" not in stored
    assert stored["data"] == {"empty": ""} and stored["metadata"]["labels"]["blank"] == ""  # map entries kept


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "status, reason, condition_reason",
    [(422, "Invalid", "ApplyRejected"), (403, "Forbidden", "Forbidden"), (400, "BadRequest", "ApplyRejected")],
)
async def test_a_refused_write_raises_apply_rejected_at_once(k8s, status, reason, condition_reason):  # noqa: F811
    emulator, client = k8s
    api = KubeApi(client, FAST)
    server_message = f'configmaps "demo-config" is refused: test {reason}'
    emulator.fail(status, reason, server_message, plural="configmaps")
    with pytest.raises(ApplyRejected) as info:
        await _in_thread(apply, api, CONFIGMAPS, _desired(), None, dry_run=True)
    assert info.value.reason == condition_reason and info.value.http_status == status
    assert "ConfigMap/demo-config" in str(info.value) and server_message in str(info.value)
    assert len([r for r in emulator if r.method == "POST"]) == 1  # no retry


@pytest.mark.asyncio
async def test_a_create_meeting_a_foreign_object_is_a_conflict_and_leaves_it_alone(k8s):  # noqa: F811
    """Regression: a user's own object of a child's name (no ownerReference, no label, so not listed) made the
    create answer 409 and the operator retried forever."""
    emulator, client = k8s
    api = KubeApi(client, FAST)
    mine = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-config", "namespace": NS},
        "data": {"user": "data"},
    }
    await _in_thread(api.create, CONFIGMAPS, NS, mine)
    for dry_run in (True, False):
        with pytest.raises(ApplyRejected) as info:
            await _in_thread(apply, api, CONFIGMAPS, _desired(), None, dry_run=dry_run)
        assert info.value.reason == "ChildConflict" and info.value.http_status == 409
    assert (await _in_thread(api.get, CONFIGMAPS, NS, "demo-config"))["data"] == {"user": "data"}


@pytest.mark.asyncio
async def test_server_errors_are_retried_then_temporary(k8s):  # noqa: F811
    emulator, client = k8s
    api = KubeApi(client, FAST)
    emulator.fail(500, "InternalError", "etcd hiccup", plural="configmaps", times=2)
    result = await _in_thread(apply, api, CONFIGMAPS, _desired(), None)
    assert result.action == "created"
    emulator.fail(503, "ServiceUnavailable", "down", plural="configmaps")
    with pytest.raises(kopf.TemporaryError):
        await _in_thread(apply, api, CONFIGMAPS, _desired(a="2"), result.obj)


@pytest.mark.asyncio
async def test_execute_dry_run_first_leaves_nothing_half_applied(k8s):  # noqa: F811
    """The second of two creates is refused (422): run as the reconciler does (every dry run, then the real
    writes), nothing at all is created."""
    emulator, client = k8s
    api = KubeApi(client, FAST)
    emulator.fail(422, "Invalid", 'Deployment.apps "demo-engine" is invalid: spec.template: bad', plural="deployments")
    dep = {**_desired("demo-engine"), "apiVersion": "apps/v1", "kind": "Deployment", "spec": {"replicas": 1}}
    dep.pop("data")
    changes = plan(CONFIGMAPS, [_desired()], [], OWNER_UID) + plan(DEPLOYMENTS, [dep], [], OWNER_UID)
    with pytest.raises(ApplyRejected) as info:
        await _in_thread(execute, api, changes, dry_run=True)
    assert "Deployment/demo-engine" in str(info.value) and "spec.template: bad" in str(info.value)
    assert await _in_thread(api.get, CONFIGMAPS, NS, "demo-config") is None


@pytest.mark.asyncio
async def test_a_rolebinding_whose_role_only_exists_in_the_dry_run_is_not_refused(k8s):  # noqa: F811
    """Regression (real clusters only): kube-apiserver answers a RoleBinding create whose roleRef Role does not exist
    with 404 when the caller lacks `bind` (the operator does, by design). The Role was only dry-run-created, so the
    RoleBinding's dry run got 404 and the first apply was refused forever. A 404 on a dry-run create now passes; the
    real phase creates the Role first, then the RoleBinding."""
    emulator, client = k8s
    emulator.require_role_refs()
    api = KubeApi(client, FAST)
    children = render_children(_isvc(), RenderOptions("radixserve:test"))
    rbac = [t for t in CHILD_TYPES if t.kind in ("Role", "RoleBinding")]
    assert [t.kind for t in rbac] == ["Role", "RoleBinding"]  # CHILD_TYPES order: the Role is created first
    changes = [c for t in rbac for c in plan(t, [d for d in children if d["kind"] == t.kind], [], OWNER_UID)]
    binding = next(c.desired for c in changes if c.rtype.kind == "RoleBinding")
    # The rule really is emulated: the RoleBinding alone is refused, dry run or not.
    for dry_run in (True, False):
        with pytest.raises(Exception) as info:
            await _in_thread(api.create, rbac[1], NS, binding, dry_run=dry_run)
        assert getattr(info.value, "status", None) == 404
    results = await _in_thread(execute, api, changes, dry_run=True)
    assert [r.action for r in results] == ["created", "created"]
    assert not [k for k in emulator.objects if k[0].plural in ("roles", "rolebindings")]  # a dry run stores nothing
    results = await _in_thread(execute, api, changes, dry_run=False)
    assert [r.action for r in results] == ["created", "created"]
    assert await _in_thread(api.get, rbac[1], NS, binding["metadata"]["name"]) is not None
    # A 404 on a REAL create is still refused (here: the Role is gone, the namespace could be).
    await _in_thread(api.delete, rbac[1], NS, binding["metadata"]["name"])
    await _in_thread(api.delete, rbac[0], NS, binding["roleRef"]["name"])
    with pytest.raises(ApplyRejected) as rejected:
        await _in_thread(apply, api, rbac[1], binding, None)
    assert rejected.value.http_status == 404 and f"RoleBinding/{binding['metadata']['name']}" in str(rejected.value)


# --- the diff behind apply (pure) --------------------------------------------------------------------------------


def _deployment(**pod_spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x", "labels": {"a": "1"}},
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "c", "image": "i:1", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
                    ],
                    **pod_spec,
                }
            },
        },
    }


def _live(desired: dict[str, Any]) -> dict[str, Any]:
    """``desired`` as the API server would store it after an apply: defaults added, quantities canonicalised."""
    import copy

    from radixserve.operator.apply import LAST_APPLIED_ANNOTATION, last_applied_record

    live = copy.deepcopy(desired)
    live["metadata"].update(
        uid="u",
        resourceVersion="7",
        annotations={LAST_APPLIED_ANNOTATION: last_applied_record(desired), "deployment.kubernetes.io/revision": "1"},
    )
    c = live["spec"]["template"]["spec"]["containers"][0]
    c.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    c["resources"]["limits"]["cpu"] = "1000m"
    c["resources"]["limits"]["memory"] = str(1024**3)
    live["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    live["status"] = {"readyReplicas": 2}
    return live


def test_defaults_other_writers_and_equal_quantities_are_not_drift():
    from radixserve.operator.apply import merge_patch_for

    desired = _deployment()
    assert merge_patch_for(desired, _live(desired)) == {}


def test_changed_fields_are_patched_and_fields_no_longer_desired_removed():
    from radixserve.operator.apply import LAST_APPLIED_ANNOTATION, merge_patch_for

    before = _deployment(nodeSelector={"gpu": "a100"})
    live = _live(before)
    after = _deployment()
    after["spec"]["replicas"] = 3
    after["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "2"
    patch = merge_patch_for(after, live)
    assert patch["spec"]["replicas"] == 3
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None  # applied before, not wanted now
    # The containers list changed since the last apply: replaced whole (merge-patch semantics).
    assert patch["spec"]["template"]["spec"]["containers"] == after["spec"]["template"]["spec"]["containers"]
    assert LAST_APPLIED_ANNOTATION in patch["metadata"]["annotations"]
    assert "status" not in patch and "labels" not in patch["metadata"]


def test_quantities_compare_by_value():
    from radixserve.operator.apply import quantity, subset_equal

    assert quantity("500m") == quantity("0.5") and quantity("1Ki") == quantity(1024) and quantity("1e3") == 1000
    assert quantity("abc") is None and quantity(True) is None
    assert subset_equal({"limits": {"cpu": "1"}}, {"limits": {"cpu": "1000m"}})
    assert not subset_equal({"limits": {"cpu": "1"}}, {"limits": {"cpu": "1001m"}})
    assert not subset_equal({"env": [{"value": "1"}]}, {"env": [{"value": "1.0"}]})  # not a quantity field
