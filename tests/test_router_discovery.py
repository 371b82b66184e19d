"""Router discovery: static URLs, and EndpointSlice list+watch against an emulated API server over real HTTP
(tests/k8s_emulator.py; the discovery thread uses the official kubernetes client)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from typing import Any

import kmock
import pytest
import pytest_asyncio

from radixserve.contracts.constants import COMPONENT_ENGINE, COMPONENT_ROUTER, LABEL_COMPONENT, LABEL_INFERENCE_SERVICE
from radixserve.contracts.kube import KubeConfigError, kube_api_client
from radixserve.router.discovery import (
    LABEL_SERVICE_NAME,
    EndpointSliceDiscovery,
    StaticDiscovery,
    endpoints_from_slices,
    normalize_url,
)
from radixserve.router.types import Endpoint

from k8s_emulator import (
    K8sEmulator,
    k8s,  # noqa: F401 - pytest fixture
    write_kubeconfig,
)

NS = "ml"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
RESOURCE = kmock.resource("discovery.k8s.io", "v1", "endpointslices")


def ep(ip: str, pod: str, ready: bool | None = True, terminating: bool | None = None) -> dict[str, Any]:
    conditions: dict[str, Any] = {}
    if ready is not None:
        conditions["ready"] = ready
    if terminating is not None:
        conditions["terminating"] = terminating
    return {"addresses": [ip], "conditions": conditions, "targetRef": {"kind": "Pod", "name": pod, "namespace": NS}}


def make_slice(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    *,
    port: int = 30000,
    ports: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL_SERVICE_NAME: service, **(labels or {})}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports if ports is not None else [{"name": "http", "port": port, "protocol": "TCP"}],
    }


def engine_labels(isvc: str) -> dict[str, str]:
    return {LABEL_INFERENCE_SERVICE: isvc, LABEL_COMPONENT: COMPONENT_ENGINE}


async def create(emu: K8sEmulator, obj: dict[str, Any]) -> None:
    resp = await emu.post(SLICES, json=obj)
    assert resp.status in (200, 201), await resp.text()


async def patch(emu: K8sEmulator, name: str, body: Any) -> None:
    ctype = "application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json"
    resp = await emu.patch(f"{SLICES}/{name}", json=body, headers={"Content-Type": ctype})
    assert resp.status == 200, await resp.text()


async def delete(emu: K8sEmulator, name: str) -> None:
    resp = await emu.delete(f"{SLICES}/{name}")
    assert resp.status == 200, await resp.text()


async def until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``predicate`` on the loop (the emulator must keep serving) until true or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


class Recorder:
    """Collects on_change calls and checks they arrive on the loop thread."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Endpoint]] = []
        self.thread = threading.get_ident()
        self.wrong_thread = False

    def __call__(self, endpoints: dict[str, Endpoint]) -> None:
        self.wrong_thread |= threading.get_ident() != self.thread
        self.calls.append(dict(endpoints))

    @property
    def urls(self) -> set[str] | None:
        return set(self.calls[-1]) if self.calls else None

    async def wait_urls(self, urls: set[str], timeout: float = 5.0) -> None:
        await until(lambda: self.urls == urls, timeout, f"urls == {sorted(urls)} (last: {self.urls})")


@pytest_asyncio.fixture
async def discoveries():
    """Start discoveries through this list; all are stopped at teardown."""
    started: list[EndpointSliceDiscovery] = []

    async def start(api: Any, **kwargs: Any) -> tuple[EndpointSliceDiscovery, Recorder]:
        kwargs.setdefault("service", "engine" if not kwargs.get("all_inference_services") else None)
        d = EndpointSliceDiscovery(NS, api_client=api, **kwargs)
        rec = Recorder()
        await d.start(rec)
        started.append(d)
        return d, rec

    yield start
    for d in started:
        await d.stop()


# --- EndpointSlice discovery over HTTP ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_initial_list_only_ready_not_terminating(k8s, discoveries):
    emu, api = k8s
    await create(
        emu,
        make_slice(
            "engine-abc",
            "engine",
            [
                ep("10.0.0.1", "p1", ready=True),
                ep("10.0.0.2", "p2", ready=None),  # conditions.ready unset: ready, per the API
                ep("10.0.0.3", "p3", ready=False),
                ep("10.0.0.4", "p4", ready=True, terminating=True),
            ],
            labels=engine_labels("chat"),
        ),
    )
    await create(
        emu, make_slice("engine-v6", "engine", [ep("fd00::7", "p7")], address_type="IPv6", labels=engine_labels("chat"))
    )
    d, rec = await discoveries(api)
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://[fd00::7]:30000"})
    assert len(rec.calls) == 1 and not rec.wrong_thread
    e = rec.calls[-1]["http://10.0.0.1:30000"]
    assert (e.service, e.inference_service, e.pod) == ("engine", "chat", "p1")
    assert e.labels[LABEL_COMPONENT] == COMPONENT_ENGINE
    assert rec.calls[-1]["http://[fd00::7]:30000"].pod == "p7"
    assert d.last_error is None and not d.is_stale() and d.age_s() is not None and d.age_s() < 5


@pytest.mark.asyncio
async def test_first_list_reports_even_when_empty(k8s, discoveries):
    _, api = k8s
    d, rec = await discoveries(api)
    await until(lambda: len(rec.calls) == 1, what="first on_change")
    assert rec.calls[0] == {} and d.age_s() is not None and not d.is_stale()


@pytest.mark.asyncio
async def test_watch_added_modified_deleted_and_readiness_flip(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
    d, rec = await discoveries(api)
    await rec.wait_urls({"http://10.0.0.1:30000"})

    await create(emu, make_slice("engine-b", "engine", [ep("10.0.1.1", "q1")]))  # ADDED
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.1.1:30000"})

    # MODIFIED: a pod goes not-ready, then ready again (JSON-patch on the endpoint's condition).
    await patch(emu, "engine-a", [{"op": "replace", "path": "/endpoints/0/conditions/ready", "value": False}])
    await rec.wait_urls({"http://10.0.1.1:30000"})
    await patch(emu, "engine-a", [{"op": "replace", "path": "/endpoints/0/conditions/ready", "value": True}])
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.1.1:30000"})

    # MODIFIED: a scale-up within a slice.
    await patch(emu, "engine-b", {"endpoints": [ep("10.0.1.1", "q1"), ep("10.0.1.2", "q2")]})
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.1.1:30000", "http://10.0.1.2:30000"})

    await delete(emu, "engine-a")  # DELETED
    await rec.wait_urls({"http://10.0.1.1:30000", "http://10.0.1.2:30000"})
    assert not rec.wrong_thread and d.last_error is None


@pytest.mark.asyncio
async def test_on_change_only_when_the_set_changes(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
    _, rec = await discoveries(api)
    await rec.wait_urls({"http://10.0.0.1:30000"})
    calls = len(rec.calls)
    # A MODIFIED event that changes nothing routable (an annotation), then one that does: exactly one more call.
    await patch(emu, "engine-a", {"metadata": {"annotations": {"note": "x"}}})
    await create(emu, make_slice("engine-b", "engine", [ep("10.0.1.1", "q1")]))
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.1.1:30000"})
    assert len(rec.calls) == calls + 1
    # A change of an endpoint's fields (same URL, another pod name) is a change.
    await patch(emu, "engine-b", {"endpoints": [ep("10.0.1.1", "q1-renamed")]})
    await until(lambda: rec.calls[-1]["http://10.0.1.1:30000"].pod == "q1-renamed", what="pod field update")
    assert len(rec.calls) == calls + 2


@pytest.mark.asyncio
async def test_port_chosen_by_name(k8s, discoveries):
    emu, api = k8s
    await create(
        emu,
        make_slice(
            "engine-a",
            "engine",
            [ep("10.0.0.1", "p1")],
            ports=[{"name": "metrics", "port": 9090}, {"name": "http", "port": 31000}],
        ),
    )
    await create(
        emu, make_slice("engine-b", "engine", [ep("10.0.0.2", "p2")], ports=[{"name": "metrics", "port": 9090}])
    )
    await create(emu, make_slice("engine-c", "engine", [ep("10.0.0.3", "p3")], ports=[{"port": 32000}]))  # unnamed
    _, rec = await discoveries(api)
    # b has no port named http: skipped; c's single unnamed port is the Service's only port: used.
    await rec.wait_urls({"http://10.0.0.1:31000", "http://10.0.0.3:32000"})

    _, rec_metrics = await discoveries(api, port_name="metrics")
    await rec_metrics.wait_urls({"http://10.0.0.1:9090", "http://10.0.0.2:9090", "http://10.0.0.3:32000"})


@pytest.mark.asyncio
async def test_other_services_ignored_and_selector_sent(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
    await create(emu, make_slice("other-a", "other", [ep("10.9.0.1", "o1")]))
    _, rec = await discoveries(api)
    await rec.wait_urls({"http://10.0.0.1:30000"})
    await create(emu, make_slice("other-b", "other", [ep("10.9.0.2", "o2")]))  # a watch event for another service
    # Relabelling our slice to another Service takes it out of scope (MODIFIED, not DELETED).
    await patch(emu, "engine-a", {"metadata": {"labels": {LABEL_SERVICE_NAME: "other"}}})
    await rec.wait_urls(set())
    # The emulator ignores selectors (as kmock does), so the filtering above was client-side; but it was sent.
    selectors = {
        r.params.get("labelSelector")
        for r in list(emu)
        if r.resource == RESOURCE and r.action in (kmock.action.LIST, kmock.action.WATCH)
    }
    assert selectors == {f"{LABEL_SERVICE_NAME}=engine"}


@pytest.mark.asyncio
async def test_namespace_wide_mode_takes_only_engine_slices(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("chat-engine-1", "chat-engine", [ep("10.0.0.1", "c1")], labels=engine_labels("chat")))
    await create(emu, make_slice("code-engine-1", "code-engine", [ep("10.0.1.1", "k1")], labels=engine_labels("code")))
    await create(
        emu,
        make_slice(
            "chat-router-1",
            "chat",
            [ep("10.0.2.1", "r1")],
            labels={LABEL_INFERENCE_SERVICE: "chat", LABEL_COMPONENT: COMPONENT_ROUTER},
        ),
    )
    await create(emu, make_slice("web-1", "web", [ep("10.0.3.1", "w1")], labels={LABEL_COMPONENT: COMPONENT_ENGINE}))
    d, rec = await discoveries(api, all_inference_services=True)
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.1.1:30000"})
    by_isvc = {e.inference_service: e.service for e in rec.calls[-1].values()}
    assert by_isvc == {"chat": "chat-engine", "code": "code-engine"}
    await create(emu, make_slice("chat-engine-2", "chat-engine", [ep("10.0.0.2", "c2")], labels=engine_labels("chat")))
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.1.1:30000"})
    assert d.label_selector == f"{LABEL_INFERENCE_SERVICE},{LABEL_COMPONENT}={COMPONENT_ENGINE}"


@pytest.mark.asyncio
async def test_address_in_two_slices_appears_once(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1"), ep("10.0.0.2", "p2")]))
    await create(emu, make_slice("engine-b", "engine", [ep("10.0.0.2", "p2"), ep("10.0.0.3", "p3")]))
    _, rec = await discoveries(api)
    await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"})
    # Deleting one of the two slices that list 10.0.0.2 keeps it.
    await delete(emu, "engine-a")
    await rec.wait_urls({"http://10.0.0.2:30000", "http://10.0.0.3:30000"})


@pytest.mark.asyncio
async def test_missed_delete_is_repaired_by_the_periodic_relist(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
    await create(emu, make_slice("engine-b", "engine", [ep("10.0.0.2", "p2")]))
    _, watch_only = await discoveries(api, relist_interval_s=60.0)  # within this test: watch events only
    _, relisting = await discoveries(api, relist_interval_s=0.5)
    both = {"http://10.0.0.1:30000", "http://10.0.0.2:30000"}
    await watch_only.wait_urls(both)
    await relisting.wait_urls(both)

    # The slice vanishes from the server without any DELETED event reaching a watch.
    del emu.objects[RESOURCE, NS, "engine-b"]
    await relisting.wait_urls({"http://10.0.0.1:30000"}, timeout=4.0)
    # Control: the watch never delivered the delete, so watch-only state still (wrongly) has the pod.
    assert watch_only.urls == both
    # And the relisting discovery keeps following live events after its re-lists.
    await create(emu, make_slice("engine-c", "engine", [ep("10.0.0.3", "p3")]))
    await relisting.wait_urls({"http://10.0.0.1:30000", "http://10.0.0.3:30000"})


@pytest.mark.asyncio
async def test_expired_resource_version_relists(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
    # stale_after_s=2 bounds each watch to 1 s, so the watch resumes from its resourceVersion (no re-list due).
    d, rec = await discoveries(api, relist_interval_s=60.0, stale_after_s=2.0)
    await rec.wait_urls({"http://10.0.0.1:30000"})
    lists = lambda: sum(1 for r in list(emu) if r.action == kmock.action.LIST and r.resource == RESOURCE)  # noqa: E731
    assert lists() == 1
    # Another resource's write moves the global resourceVersion past the watch's, then etcd compacts: the next
    # watch, resuming from its (now too old) resourceVersion, gets 410 Expired.
    resp = await emu.post(f"/api/v1/namespaces/{NS}/configmaps", json={"metadata": {"name": "cm"}, "data": {}})
    assert resp.status in (200, 201)
    emu.compact()
    del emu.objects[RESOURCE, NS, "engine-a"]  # and a change it can only learn from the re-list
    await rec.wait_urls(set(), timeout=4.0)
    assert lists() >= 2 and d.last_error is None
    await create(emu, make_slice("engine-b", "engine", [ep("10.0.0.2", "p2")]))
    await rec.wait_urls({"http://10.0.0.2:30000"})


@pytest.mark.asyncio
async def test_unreachable_api_server_sets_error_goes_stale_and_recovers(tmp_path):
    emu = K8sEmulator()
    emu.resources.load_bundled()
    async with emu:
        server = kmock.Server(emu)
        await server.__aenter__()
        port = server.port
        import kubernetes

        api = kubernetes.config.new_client_from_config(
            config_file=write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        )
        await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
        d = EndpointSliceDiscovery(NS, "engine", relist_interval_s=0.5, stale_after_s=1.0, api_client=api)
        rec = Recorder()
        await d.start(rec)
        try:
            await rec.wait_urls({"http://10.0.0.1:30000"})
            assert not d.is_stale()

            await server.__aexit__(None, None, None)  # the API server goes away
            await until(lambda: d.last_error is not None, what="last_error")
            await until(d.is_stale, timeout=4.0, what="is_stale")
            assert d.age_s() > 1.0
            assert rec.urls == {"http://10.0.0.1:30000"}  # the last known endpoints are kept meanwhile

            emu.objects[RESOURCE, NS, "engine-b"] = make_slice("engine-b", "engine", [ep("10.0.0.2", "p2")])
            server = kmock.Server(emu, port=port)  # it comes back, with a change made while it was away
            await server.__aenter__()
            await rec.wait_urls({"http://10.0.0.1:30000", "http://10.0.0.2:30000"}, timeout=8.0)
            await until(lambda: d.last_error is None and not d.is_stale(), what="recovery")
        finally:
            await d.stop()
            api.close()
            if server.handler.servers:
                await server.__aexit__(None, None, None)


@pytest.mark.asyncio
async def test_stop_is_prompt_during_an_idle_watch(k8s, discoveries):
    emu, api = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
    d = EndpointSliceDiscovery(NS, "engine", api_client=api)  # default 30 s re-list: a long idle watch
    rec = Recorder()
    await d.start(rec)
    await rec.wait_urls({"http://10.0.0.1:30000"})
    await until(lambda: any(r.action == kmock.action.WATCH for r in list(emu)), what="watch started")
    thread = d._thread
    t0 = time.monotonic()
    await d.stop()
    assert time.monotonic() - t0 < 2.5  # the contract is < 2 s; slack for a loaded machine
    assert thread is not None and not thread.is_alive()
    calls = len(rec.calls)
    await create(emu, make_slice("engine-b", "engine", [ep("10.0.0.2", "p2")]))
    await asyncio.sleep(0.2)
    assert len(rec.calls) == calls  # nothing is delivered after stop()


@pytest.mark.asyncio
async def test_default_client_comes_from_the_kubeconfig(k8s):
    emu, _ = k8s
    await create(emu, make_slice("engine-a", "engine", [ep("10.0.0.1", "p1")]))
    d = EndpointSliceDiscovery(NS, "engine")  # no api_client: kube_api_client() finds the test's kubeconfig
    rec = Recorder()
    await d.start(rec)
    try:
        await rec.wait_urls({"http://10.0.0.1:30000"})
    finally:
        await d.stop()


def test_kube_api_client_without_any_config_is_a_clear_error(tmp_path, monkeypatch):
    import kubernetes

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing"))
    with pytest.raises(KubeConfigError, match="not running in a pod"):
        kube_api_client()


def test_kube_api_client_reads_the_kubeconfig(tmp_path, monkeypatch):
    import kubernetes

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:6443")
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", path)
    api = kube_api_client()
    try:
        assert api.configuration.host == "http://127.0.0.1:6443"
    finally:
        api.close()


def test_endpoint_slice_discovery_argument_errors():
    with pytest.raises(ValueError):
        EndpointSliceDiscovery("", "engine")
    with pytest.raises(ValueError):
        EndpointSliceDiscovery(NS)  # neither a service nor namespace-wide
    with pytest.raises(ValueError):
        EndpointSliceDiscovery(NS, "engine", all_inference_services=True)
    with pytest.raises(ValueError):
        EndpointSliceDiscovery(NS, "engine", relist_interval_s=0)
    d = EndpointSliceDiscovery(NS, "engine")
    assert d.kind == "kubernetes" and d.age_s() is None and d.is_stale()  # no data before start


def test_endpoints_from_slices_pure():
    s = make_slice("a", "svc", [ep("10.0.0.1", "p1", ready=None), ep("10.0.0.2", "p2", ready=False)])
    s2 = copy.deepcopy(s)
    s2["metadata"]["name"] = "b"
    s2["endpoints"] = None  # the API sends null for a Service with no endpoints
    s3 = make_slice("c", "svc", [{"addresses": ["10.0.0.3"]}])  # no conditions at all, no targetRef
    # A pod being deleted, as the EndpointSlice controller reports it during its termination grace period: still
    # serving (its readiness probe passes) but terminating, and ready false. Serving false alone excludes it too.
    s4 = make_slice(
        "d",
        "svc",
        [
            {"addresses": ["10.0.0.4"], "conditions": {"ready": False, "serving": True, "terminating": True}},
            {"addresses": ["10.0.0.5"], "conditions": {"serving": False}},
            {"addresses": ["10.0.0.6"], "conditions": {"ready": True, "serving": True, "terminating": False}},
        ],
    )
    got = endpoints_from_slices([s, s2, s3, s4])
    assert got == {
        "http://10.0.0.1:30000": Endpoint("http://10.0.0.1:30000", "svc", None, "p1"),
        "http://10.0.0.3:30000": Endpoint("http://10.0.0.3:30000", "svc", None, None),
        "http://10.0.0.6:30000": Endpoint("http://10.0.0.6:30000", "svc", None, None),
    }


# --- static discovery ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, want",
    [
        ("localhost:30000", "http://localhost:30000"),
        ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
        ("HTTPS://Engine.Example:443//", "https://engine.example:443"),
        ("http://[::1]:30001", "http://[::1]:30001"),
        ("10.0.0.5", "http://10.0.0.5"),
        ("http://proxy.local/engines/0/", "http://proxy.local/engines/0"),
        ("  http://a:1  ", "http://a:1"),
    ],
)
def test_normalize_url(raw, want):
    assert normalize_url(raw) == want


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "   ",
        "http://",
        "ftp://host:21",
        "host:notaport",
        "http://a:99999",
        "http://a b:1",
        "http://a:1/?q=1",
        "http://user:pw@a:1",
        "::1:30000",
    ],
)
def test_normalize_url_rejects_junk(junk):
    with pytest.raises(ValueError):
        normalize_url(junk)


@pytest.mark.asyncio
async def test_static_discovery():
    d = StaticDiscovery(["localhost:30000", "http://localhost:30000/", "http://127.0.0.1:30001"])
    assert d.kind == "static" and d.age_s() is None
    rec = Recorder()
    await d.start(rec)
    assert rec.calls == [
        {
            "http://localhost:30000": Endpoint("http://localhost:30000"),
            "http://127.0.0.1:30001": Endpoint("http://127.0.0.1:30001"),
        }
    ]
    assert list(rec.calls[0]) == ["http://localhost:30000", "http://127.0.0.1:30001"]  # order kept
    assert d.age_s() is not None and d.age_s() >= 0 and not d.is_stale() and d.last_error is None
    await d.stop()


def test_static_discovery_errors():
    with pytest.raises(ValueError):
        StaticDiscovery([])
    with pytest.raises(ValueError):
        StaticDiscovery("http://a:1")  # a bare string is not a list of URLs
    with pytest.raises(ValueError, match="invalid worker URL"):
        StaticDiscovery(["http://ok:1", "ftp://bad"])
