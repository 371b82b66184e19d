"""The chart's RBAC is least privilege for what the operator really does.

The operator runs for real (kopf, in-process) against the API emulator through a scenario that makes every kind of
call it makes (tests/operator_scenario.py); the chart is rendered with the real helm binary. Every call seen must be
granted by the chart, and every grant must be a call seen or one of the reviewed calls only a real cluster triggers
(REAL_CLUSTER_ONLY, each with its reason), so a grant nobody uses fails this test as much as a missing one.
"""

from __future__ import annotations

import pytest

from radixserve.operator.render import CHILD_TYPES

from helm import helm_template
from k8s_emulator import k8s  # noqa: F401 - fixture
from operator_scenario import representative_api_calls

# (verb, apiGroup, resource) granted although the scenario does not make the call, with the reason.
REAL_CLUSTER_ONLY: dict[tuple[str, str, str], str] = {
    # Every child kind takes every apply/prune verb (operator/apply.py): a hand-edited child of any kind is
    # merge-patched, a create that meets a 409 re-reads with get, and prune deletes any labelled, owned child no
    # longer desired; the scenario only edits and deletes some kinds.
    **{
        (verb, t.api_version.rpartition("/")[0], t.plural): "apply/prune path for every child kind"
        for t in CHILD_TYPES
        for verb in ("get", "list", "watch", "create", "patch", "delete")
    },
    # blockOwnerDeletion on the children's ownerReferences: the OwnerReferencesPermissionEnforcement admission plugin
    # (on in OpenShift) checks update on the owner's finalizers.
    ("update", "radixserve.io", "inferenceservices/finalizers"): "OwnerReferencesPermissionEnforcement",
    # kopf lists/watches namespaces when it serves a namespace list (--namespace); the scenario runs cluster-wide.
    ("list", "", "namespaces"): "kopf with --namespace",
    ("watch", "", "namespaces"): "kopf with --namespace",
    # RBAC escalation prevention: the operator may only create the router's Role (endpointslices get/list/watch)
    # if it holds every permission in it.
    ("get", "discovery.k8s.io", "endpointslices"): "held to grant it to the router's Role",
    ("watch", "discovery.k8s.io", "endpointslices"): "held to grant it to the router's Role",
    # kopf's resource discovery re-scans CRDs on a real cluster (the emulator's discovery is static).
    ("list", "apiextensions.k8s.io", "customresourcedefinitions"): "kopf watches CRDs (re)appearing",
    ("watch", "apiextensions.k8s.io", "customresourcedefinitions"): "kopf watches CRDs (re)appearing",
}


def granted_by_chart(values: dict | None = None) -> set[tuple[str, str, str]]:
    """(verb, apiGroup, resource) triples granted to the operator by the rendered chart's (Cluster)Roles."""
    grants: set[tuple[str, str, str]] = set()
    for obj in helm_template(values):
        if obj.get("kind") not in ("ClusterRole", "Role"):
            continue
        labels = obj["metadata"].get("labels") or {}
        if labels.get("app.kubernetes.io/component") not in (None, "operator"):
            continue
        for rule in obj.get("rules") or []:
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    for verb in rule.get("verbs", []):
                        grants.add((verb, group, resource))
    return grants


@pytest.fixture(scope="module")
def chart_grants() -> set[tuple[str, str, str]]:
    return granted_by_chart()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_chart_grants_exactly_the_calls_the_operator_makes(k8s, chart_grants):  # noqa: F811
    emulator, api = k8s
    seen = await representative_api_calls(emulator, api)
    missing = seen - chart_grants
    assert not missing, f"the operator made calls the chart does not grant: {sorted(missing)}"
    unused = chart_grants - seen - set(REAL_CLUSTER_ONLY)
    assert not unused, f"the chart grants calls the operator never made (and not reviewed): {sorted(unused)}"
    assert set(REAL_CLUSTER_ONLY) <= chart_grants, sorted(set(REAL_CLUSTER_ONLY) - chart_grants)
