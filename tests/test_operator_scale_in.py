"""Cache-aware scale-in (issue 16, item 2), against the API server emulator: the operator reads each engine pod's cache
heat from its ``/metrics`` (the real engine HTTP layer over fake engines) and, right before it lowers the engine
Deployment's replicas, writes ``controller.kubernetes.io/pod-deletion-cost`` on the pods, so the ReplicaSet
controller (which the emulator lacks: the test plays it) removes the pod that served the fewest cached tokens
recently, not the newest one. Plus the pure parts of ``operator/cache_heat.py``."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app as engine_app
from radixserve.operator.cache_heat import (
    DELETION_COST_ANNOTATION,
    CacheHeat,
    EnginePod,
    deletion_costs,
    engine_pods,
    parse_cached_tokens,
)

from fake_engine import FakeEngine, ServerThread, load_tokenizer
from k8s_emulator import k8s  # noqa: F401 - fixture
from operator_scenario import (
    OperatorHarness,
    child_path,
    engine_pod_body,
    isvc_body,
    isvc_path,
    until,
    writes,
)

NAME = "chat"


def deletion_cost(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["annotations"][DELETION_COST_ANNOTATION])


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_scale_in_removes_the_engine_with_the_coldest_cache(k8s):  # noqa: F811
    emulator, api = k8s
    tok = load_tokenizer()
    engines = {pod: FakeEngine(tok) for pod in ("chat-engine-a", "chat-engine-b", "chat-engine-c")}
    reads = {pod: 0 for pod in engines}
    for pod, engine in engines.items():  # count the operator's reads of each engine's /metrics
        render = engine.metrics.render

        def counted(pod: str = pod, render: Any = render) -> tuple[bytes, str]:
            reads[pod] += 1
            return render()

        engine.metrics.render = counted  # type: ignore[method-assign]
    # a served many cached tokens long ago and none since; b and c serve them now, b the most.
    engines["chat-engine-a"].metrics.cached_tokens_total.inc(5_000_000)
    h = OperatorHarness(emulator, api)
    with contextlib.ExitStack() as stack:
        urls = {p: stack.enter_context(ServerThread(engine_app(e, manage_engine=False))) for p, e in engines.items()}
        await h.start(resync_seconds=0.3)  # the heat is read at most every resync
        try:
            await h.create(isvc_path(), isvc_body(NAME, {**isvc_body(NAME)["spec"], "replicas": 3}))
            deployment = child_path("apps/v1", "deployments", constants.engine_deployment_name(NAME))
            await until(lambda: h.get(deployment), what="engine Deployment")
            for pod, url in urls.items():  # what the ReplicaSet controller and the kubelet would have made
                await h.create(child_path("v1", "pods"), engine_pod_body(NAME, pod, int(url.rsplit(":", 1)[1])))
            for _ in range(12):  # ~2 s of traffic, over several of the operator's reads
                engines["chat-engine-b"].metrics.cached_tokens_total.inc(9000)
                engines["chat-engine-c"].metrics.cached_tokens_total.inc(3000)
                await asyncio.sleep(0.15)
            await until(lambda: min(reads.values()) >= 3, what="three reads of every engine's /metrics")
            # Reading the heat writes nothing: no pod is annotated until a scale-in.
            assert not writes(h.requests(), "PATCH", "pods")
            mark = len(h.requests())
            await h.patch(isvc_path(NAME), {"spec": {"replicas": 2}})
            await until(lambda: _replicas(h, deployment, 2), what="engine Deployment scaled to 2")
        finally:
            await h.stop()
    log = h.requests(mark)
    pod_patches = writes(log, "PATCH", "pods")
    (scale,) = [r for r in writes(log, "PATCH", "deployments") if (r.data or {}).get("spec", {}).get("replicas") == 2]
    assert len(pod_patches) == 3 and all(log.index(p) < log.index(scale) for p in pod_patches)  # costs first
    pods = {p: await h.get(child_path("v1", "pods", p)) for p in engines}
    costs = {p: deletion_cost(pod) for p, pod in pods.items() if pod}
    assert costs["chat-engine-a"] == 0 < costs["chat-engine-c"] < costs["chat-engine-b"], costs
    # The ReplicaSet controller, among ready pods, deletes the lowest pod-deletion-cost first: a, the coldest, not
    # the newest (c).
    assert min(costs, key=lambda p: costs[p]) == "chat-engine-a"
    events = [e for e in await h.events() if e.get("reason") == "ScaleIn"]
    assert events and "engines 3 -> 2" in events[-1]["message"] and "chat-engine-a 0" in events[-1]["message"]


async def _replicas(h: OperatorHarness, path: str, n: int) -> bool:
    return ((await h.get(path)) or {}).get("spec", {}).get("replicas") == n


# --- the pure parts -------------------------------------------------------------------------------------------------


def test_parse_cached_tokens_sums_the_counter_and_ignores_the_rest():
    text = (
        "# HELP radixserve_engine_cached_tokens_total Prompt tokens served from the radix cache\n"
        "# TYPE radixserve_engine_cached_tokens_total counter\n"
        'radixserve_engine_cached_tokens_total{model_name="a"} 1200.0\n'
        'radixserve_engine_cached_tokens_total{model_name="b"} 34.0\n'
        'radixserve_engine_cached_tokens_created{model_name="a"} 1.7e9\n'
        'radixserve_engine_prompt_tokens_total{model_name="a"} 99999.0\n'
    )
    assert parse_cached_tokens(text) == 1234.0
    assert parse_cached_tokens("radixserve_engine_prompt_tokens_total 5\n") is None


def test_engine_pods_read_the_metrics_url_of_ready_pods_only():
    ready = engine_pod_body(NAME, "p1", 31000)
    ready["metadata"].update(uid="u1", annotations={DELETION_COST_ANNOTATION: "42"})
    ready["status"]["startTime"] = "2026-01-01T00:00:00Z"
    not_ready = engine_pod_body(NAME, "p2", 31001, ready=False)
    going = engine_pod_body(NAME, "p3", 31002)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    ipv6 = engine_pod_body(NAME, "p4", 30000)
    ipv6["status"]["podIP"] = "fd00::4"
    got = {p.name: p for p in engine_pods([not_ready, going, ready, ipv6])}
    assert sorted(got) == ["p1", "p2", "p4"]  # a pod being deleted is not chosen again
    assert got["p1"].metrics_url == "http://127.0.0.1:31000/metrics" and got["p1"].cost == 42
    assert got["p1"].started_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert got["p2"].metrics_url is None and got["p2"].cost is None
    assert got["p4"].metrics_url == "http://[fd00::4]:30000/metrics"


def test_heat_is_the_recent_rate_reset_by_a_restart_and_estimated_from_uptime_once():
    now = [1000.0]
    counters: dict[str, float | None] = {}
    wall = datetime(2026, 1, 1, 1, 0, tzinfo=UTC)
    heat = CacheHeat(window_s=600, min_interval_s=10, fetch=lambda url: counters[url], clock=lambda: now[0])
    heat.wall = lambda: wall
    hot = EnginePod("hot", "u-hot", "hot", started_at=wall - timedelta(minutes=30))
    idle = EnginePod("idle", "u-idle", "idle", started_at=wall - timedelta(minutes=30))
    gone = EnginePod("gone", "u-gone", None)
    pods = [hot, idle, gone]
    counters.update(hot=6000.0, idle=90000.0)
    heat.sample("ns/x", pods)
    # One sample: the counter over the uptime (30 min).
    assert heat.heat("ns/x", hot) == pytest.approx(200.0) and heat.heat("ns/x", idle) == pytest.approx(3000.0)
    assert heat.heat("ns/x", gone) == 0.0  # never read: cold
    assert not heat.due("ns/x")
    now[0] += 60
    assert heat.due("ns/x")
    counters.update(hot=18000.0, idle=90000.0)
    heat.sample("ns/x", pods)
    assert heat.heat("ns/x", hot) == pytest.approx(12000.0) and heat.heat("ns/x", idle) == 0.0  # per minute
    now[0] += 60
    counters.update(hot=500.0)  # restarted: its old counter (and cache) are gone
    heat.sample("ns/x", pods)
    assert heat.heat("ns/x", hot) == pytest.approx(500 / 30)  # one sample again: over the uptime
    # Samples older than the window stop counting.
    for _ in range(12):
        now[0] += 60
        heat.sample("ns/x", pods)
    assert heat.heat("ns/x", hot) == 0.0
    heat.sample("ns/x", [idle])  # hot left the listing: forgotten
    assert heat.heat("ns/x", hot) == pytest.approx(0.0) and ("ns/x", "u-hot") not in heat._series
    assert deletion_costs({"a": 0.4, "b": 1234.9, "c": 1e12, "d": -1.0}) == {"a": 0, "b": 1234, "c": 2**31 - 1, "d": 0}
