"""Running the real operator (kopf, in-process) against the API server emulator, and what it asked of the server.

Shared by tests/test_operator_kopf.py and a later RBAC test: ``OperatorHarness`` starts ``run_operator`` on the test's
event loop against a ``k8s`` fixture emulator (tests/k8s_emulator.py) with the InferenceService CRD declared in its
discovery; ``api_calls(emulator)`` turns the emulator's request log into RBAC terms; ``representative_api_calls``
runs a scenario that exercises every kind of call the operator makes (create, update, child deleted and
hand-edited, autoscaling and NetworkPolicy on/off, PDB off, invalid spec, deletion) and returns them.

The emulator has no controllers, garbage collection or admission: Deployment status is whatever a test writes, and
children of a deleted InferenceService stay (a real cluster's garbage collector would delete them).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import kmock

from radixserve.contracts import constants
from radixserve.operator.main import OperatorConfig, run_operator
from radixserve.operator.metrics import OperatorMetrics

from conftest import free_port

NS = "ml"
ISVC_API = f"/apis/{constants.API_GROUP}/{constants.API_VERSION}"
SAMPLE_SPEC: dict[str, Any] = {"model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"}}
# Sent by the test's own requests (creating InferenceServices, writing Deployment status, ...) so api_calls() can
# tell them from the operator's.
TEST_CLIENT_HEADERS = {"x-radixserve-test-client": "1"}
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "UPDATE": "patch", "DELETE": "delete"}


def declare_crd(emulator: Any) -> None:
    """Discovery for the InferenceService CRD (the emulator stores custom objects but does not read CRDs)."""
    emulator.resources[f"{constants.API_GROUP}/{constants.API_VERSION}/{constants.CRD_PLURAL}"] = kmock.ResourceInfo(
        kind=constants.CRD_KIND,
        namespaced=True,
        singular=constants.CRD_KIND.lower(),
        shortnames={constants.CRD_SHORT_NAME},
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete", "deletecollection"},
    )


def isvc_path(name: str | None = None, namespace: str = NS, subresource: str | None = None) -> str:
    path = f"{ISVC_API}/namespaces/{namespace}/{constants.CRD_PLURAL}"
    return path + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def child_path(api_version: str, plural: str, name: str | None = None, namespace: str = NS) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


def isvc_body(name: str, spec: dict[str, Any] | None = None, namespace: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": f"{constants.API_GROUP}/{constants.API_VERSION}",
        "kind": constants.CRD_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": copy.deepcopy(spec or SAMPLE_SPEC),
    }


async def until(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``predicate`` (sync or async) on the loop until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


class OperatorHarness:
    """The emulator plus a running operator. ``await start(resync_seconds)``, ``await stop()``; HTTP helpers."""

    def __init__(self, emulator: Any, api: Any) -> None:
        self.emu = emulator
        self.api = api
        self.metrics = OperatorMetrics()
        self.metrics_port: int | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        declare_crd(emulator)

    async def start(self, resync_seconds: float = 600.0, metrics: bool = False) -> None:
        """Start the operator (and its /metrics + /healthz on a free port, ``self.metrics_port``, if ``metrics``).

        kopf runs in its own thread and event loop: at exit ``kopf.operator`` cancels every task of its loop that
        started after it did, which on the test's loop would include the emulator's request handlers and the
        fixture's teardown."""
        self._stop, ready = threading.Event(), threading.Event()
        metrics_port = None
        if metrics:
            metrics_port = self.metrics_port = free_port()
        config = OperatorConfig(
            image="radixserve:test",
            all_namespaces=True,
            resync_seconds=resync_seconds,
            metrics_host="127.0.0.1",
            metrics_port=metrics_port,
        )

        def run() -> None:
            try:
                asyncio.run(
                    run_operator(
                        config, api_client=self.api, stop_flag=self._stop, ready_flag=ready, metrics=self.metrics
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - reported by start()/stop()
                self._error = exc

        self._thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
        self._thread.start()
        await until(lambda: ready.is_set() or not self._thread.is_alive(), timeout=30, what="kopf ready")
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            assert self._stop is not None
            self._stop.set()
            await until(lambda: not self._thread.is_alive(), timeout=30, what="kopf stopped")
        if self._error is not None:
            raise self._error

    # --- HTTP helpers -----------------------------------------------------------------------------------------------

    async def get(self, path: str) -> dict[str, Any] | None:
        resp = await self.emu.get(path, headers=TEST_CLIENT_HEADERS)
        if resp.status == 404:
            return None
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.emu.post(path, json=body, headers=TEST_CLIENT_HEADERS)
        assert resp.status in (200, 201), await resp.text()
        return await resp.json()

    async def patch(self, path: str, body: Any) -> dict[str, Any]:
        ctype = "application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json"
        resp = await self.emu.patch(path, json=body, headers={"Content-Type": ctype, **TEST_CLIENT_HEADERS})
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def delete(self, path: str) -> None:
        resp = await self.emu.delete(path, headers=TEST_CLIENT_HEADERS)
        assert resp.status == 200, await resp.text()

    async def isvc(self, name: str) -> dict[str, Any] | None:
        return await self.get(isvc_path(name))

    async def condition(self, name: str, type_: str) -> dict[str, Any]:
        obj = await self.isvc(name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})

    async def events(self, namespace: str = NS) -> list[dict[str, Any]]:
        return ((await self.get(f"/api/v1/namespaces/{namespace}/events")) or {}).get("items") or []

    def requests(self, since: int = 0) -> list[Any]:
        """The request log from position ``since`` (len(self.requests()) marks a point)."""
        return list(self.emu)[since:]


def is_dry_run(request: Any) -> bool:
    """A request sent with ``?dryRun=All`` (validated by the server, nothing stored)."""
    return (request.params or {}).get("dryRun") == "All"


def writes(
    requests: list[Any],
    method: str,
    plural: str | None = None,
    name: str | None = None,
    subresource: str | None = "",
    dry_run: bool | None = False,
) -> list[Any]:
    """Requests of ``method`` (PATCH, POST, DELETE) to ``plural``/``name`` (for POST: the body's name);
    ``subresource=""``: the main resource; ``dry_run``: False (default) the real writes only, True the dry runs
    only, None both."""

    def target(r: Any) -> Any:
        return (
            r.name if r.name is not None or not isinstance(r.data, dict) else (r.data.get("metadata") or {}).get("name")
        )

    return [
        r
        for r in requests
        if r.method == method
        and r.resource is not None
        and (plural is None or r.resource.plural == plural)
        and (name is None or target(r) == name)
        and (subresource is None or (r.subresource or "") == subresource)
        and (dry_run is None or is_dry_run(r) == dry_run)
    ]


def api_calls(emulator: Any) -> set[tuple[str, str, str]]:
    """Every (verb, apiGroup, resource[/subresource]) the operator sent (the emulator's request log without the
    test's own requests), in RBAC terms (the core group
    is ""). Requests that are not Kubernetes API calls (discovery of /api, /apis, /version) are left out."""
    calls = set()
    for r in emulator:
        if r.resource is None or r.resource.plural is None or r.action is None:
            continue
        if any(k.lower() == "x-radixserve-test-client" for k in r.headers):
            continue  # the test's own request, not the operator's
        verb = VERBS[r.action.name]
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        calls.add((verb, r.resource.group or "", resource))
    return calls


async def representative_api_calls(emulator: Any, api: Any) -> set[tuple[str, str, str]]:
    """Run the operator through a scenario that makes every kind of call it makes (module doc) and return
    ``api_calls(emulator)``. Needs the ``k8s`` fixture's ``(emulator, api)``; takes a few seconds."""
    h = OperatorHarness(emulator, api)
    await h.start(resync_seconds=1.0)
    try:
        await h.create(isvc_path(), isvc_body("demo"))
        engine = child_path("apps/v1", "deployments", constants.engine_deployment_name("demo"))
        await until(lambda: h.get(engine), what="engine Deployment")
        # Cache-aware scale-in: an engine pod (its metrics unreachable: cold) is annotated before 2 -> 1.
        await h.create(child_path("v1", "pods"), engine_pod_body("demo", "demo-engine-1", closed_port()))
        await h.patch(isvc_path("demo"), {"spec": {"replicas": 2}})
        await until(lambda: _replicas(h, engine, 2), what="engine Deployment scaled to 2")
        await h.patch(isvc_path("demo"), {"spec": {"replicas": 1}})
        pod = child_path("v1", "pods", "demo-engine-1")
        await until(lambda: _annotated(h, pod), what="engine pod's deletion cost")
        await h.delete(child_path("v1", "services", constants.router_service_name("demo")))
        await until(
            lambda: h.get(child_path("v1", "services", constants.router_service_name("demo"))),
            what="router Service recreated",
        )
        await h.patch(
            isvc_path("demo"),
            {
                "spec": {
                    "autoscaling": {"maxReplicas": 3, "targetPerPod": 4},
                    "disruptionBudget": {"enabled": False},
                    "networkPolicy": {"enabled": True},
                }
            },
        )
        hpa = child_path("autoscaling/v2", "horizontalpodautoscalers", "demo")
        policy = child_path("networking.k8s.io/v1", "networkpolicies", constants.engine_deployment_name("demo"))
        await until(lambda: h.get(hpa), what="HPA")
        await until(lambda: h.get(policy), what="NetworkPolicy")
        await h.patch(isvc_path("demo"), {"spec": {"autoscaling": None, "networkPolicy": {"enabled": False}}})
        await until(lambda: _absent(h, hpa), what="HPA deleted")
        await until(lambda: _absent(h, policy), what="NetworkPolicy deleted")
        await h.create(isvc_path(), isvc_body("bad", {"model": {"storageUri": "ftp://nope"}}))
        await until(lambda: _reason(h, "bad", "Degraded", "InvalidSpec"), what="InvalidSpec")
        await h.delete(isvc_path("demo"))
        await until(lambda: _absent(h, isvc_path("demo")), what="InferenceService deleted")
    finally:
        await h.stop()
    return api_calls(emulator)


def engine_pod_body(isvc: str, name: str, port: int, namespace: str = NS, ready: bool = True) -> dict[str, Any]:
    """An engine pod of InferenceService ``isvc`` as the ReplicaSet controller and the kubelet would leave it (the
    emulator has neither): the engine pod labels, container port ``http`` = ``port`` on 127.0.0.1, Ready."""
    labels = {
        constants.LABEL_NAME: constants.LABEL_NAME_VALUE,
        constants.LABEL_COMPONENT: constants.COMPONENT_ENGINE,
        constants.LABEL_INFERENCE_SERVICE: isvc,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "containers": [
                {"name": "engine", "image": "radixserve:test", "ports": [{"name": "http", "containerPort": port}]}
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def closed_port() -> int:
    """A port nothing listens on (connections are refused)."""
    return free_port()


async def _replicas(h: OperatorHarness, path: str, n: int) -> bool:
    return ((await h.get(path)) or {}).get("spec", {}).get("replicas") == n


async def _annotated(h: OperatorHarness, path: str) -> bool:
    annotations = (((await h.get(path)) or {}).get("metadata") or {}).get("annotations") or {}
    return "controller.kubernetes.io/pod-deletion-cost" in annotations


async def _absent(h: OperatorHarness, path: str) -> bool:
    return await h.get(path) is None


async def _reason(h: OperatorHarness, name: str, type_: str, reason: str) -> bool:
    return (await h.condition(name, type_)).get("reason") == reason
