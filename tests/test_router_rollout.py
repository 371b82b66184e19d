"""A rolling update of the engine Deployment under streaming load loses no stream (issue 16, item 6), in the emulated
cluster: EndpointSlices in the API server emulator (tests/k8s_emulator.py), the router built from its
``--service-discovery`` flags, engines that drain as the engine contract says (tests/draining_engine.py over fake
engines). The emulator has no controllers, so the test plays the Deployment controller, the EndpointSlice controller
and the kubelet, following the engine Deployment the operator renders: one new pod at a time (maxSurge 1), an old pod
terminated only once its replacement is ready (maxUnavailable 0); a terminated pod's endpoint turns terminating at
once, its preStop sleep runs (scaled down 5x), then SIGTERM starts its drain, and it goes once its requests are done.

Checked: every stream started during the rollout ends normally (all its tokens, a finish reason, ``[DONE]``, no error
event), the router drops a terminating engine from its workers within the preStop sleep and so sends it nothing after
its SIGTERM (no request is refused by a draining engine), each old engine had streams in flight when it was terminated
and finished them, and once the rollout is done every request goes to the new engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app as engine_app
from radixserve.operator.render import ENGINE_CONTAINER, RenderOptions, render_children
from radixserve.operator.spec import InferenceService
from radixserve.router.app import create_app
from radixserve.router.config import RouterArgs
from test_router_discovery import NS, create, delete, make_slice, patch

from draining_engine import DrainingEngineApp
from fake_engine import FakeEngine, ServerThread, load_tokenizer
from k8s_emulator import k8s  # noqa: F401 - pytest fixture

ISVC = "chat"
SERVICE = constants.engine_deployment_name(ISVC)
TIME_SCALE = 0.2  # the rendered preStop sleep and grace period (seconds) run this many times as long here
TOKENS = 50  # per stream: ~1 s at 20 ms a token
LONG = "one two three four five six seven eight nine ten " * 40


@dataclass
class Pod:
    """An engine pod: its server, its EndpointSlice, whether the test has terminated it."""

    name: str
    app: DrainingEngineApp
    server: ServerThread
    url: str = ""
    terminated_at: float | None = None
    inflight_at_termination: int = 0

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class Load:
    """Streams through the router, ``concurrency`` at a time, until ``stop``; each outcome recorded."""

    url: str
    concurrency: int = 4
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (worker, "ok" or what went wrong)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(self._loop(client, i) for i in range(self.concurrency)))

    async def _loop(self, client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {"prompt": f"client {i} request {n}", "max_tokens": TOKENS, "stream": True}
            worker, outcome = "?", "no answer"
            try:
                async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                    worker = r.headers.get(constants.HEADER_WORKER, "?")
                    lines = [line async for line in r.aiter_lines() if line]
                outcome = _outcome(r.status_code, lines)
            except httpx.HTTPError as e:
                outcome = f"{type(e).__name__}: {e}"
            self.outcomes.append((worker, outcome))


def _outcome(status: int, lines: list[str]) -> str:
    if status != 200:
        return f"HTTP {status}: {lines[:1]}"
    if not lines or lines[-1] != "data: [DONE]":
        return f"cut: {lines[-1:]}"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    if any("error" in e for e in events):
        return f"error event: {events[-1]}"
    tokens = sum(len(e["choices"]) for e in events if e.get("choices"))
    if events[-1]["choices"][0]["finish_reason"] != "length" or tokens < TOKENS:
        return f"short: {tokens} tokens"
    return "ok"


def rendered_engine_deployment() -> dict[str, Any]:
    isvc = InferenceService.model_validate(
        {
            "metadata": {"name": ISVC, "namespace": NS},
            "spec": {"model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"}, "replicas": 2},
        }
    )
    (dep,) = [
        c
        for c in render_children(isvc, RenderOptions(image="radixserve:test"))
        if c["kind"] == "Deployment" and c["metadata"]["name"] == SERVICE
    ]
    return dep


def endpoint(pod: Pod, **conditions: bool) -> dict[str, Any]:
    return {
        "addresses": ["127.0.0.1"],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": pod.name, "namespace": NS},
    }


async def wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_rolling_update_of_the_engines_loses_no_stream(k8s):  # noqa: F811
    emulator, _ = k8s
    dep = rendered_engine_deployment()
    strategy = dep["spec"]["strategy"]["rollingUpdate"]
    assert (strategy["maxSurge"], strategy["maxUnavailable"]) == (1, 0)  # what this controller plays
    pod_spec = dep["spec"]["template"]["spec"]
    (engine_c,) = [c for c in pod_spec["containers"] if c["name"] == ENGINE_CONTAINER]
    pre_stop_s = int(engine_c["lifecycle"]["preStop"]["exec"]["command"][-1]) * TIME_SCALE
    grace_s = pod_spec["terminationGracePeriodSeconds"] * TIME_SCALE
    tok = load_tokenizer()

    def new_pod(name: str) -> Pod:
        engine = FakeEngine(tok, delay_s=0.02)
        engine.set_outputs([LONG])
        app = DrainingEngineApp(engine_app(engine, manage_engine=False))
        return Pod(name, app, ServerThread(app))

    with contextlib.ExitStack() as stack:

        def start(pod: Pod) -> Pod:
            pod.url = stack.enter_context(pod.server)
            return pod

        old = [start(new_pod(f"{SERVICE}-old-{i}")) for i in range(2)]
        for pod in old:
            await create(emulator, make_slice(pod.name, SERVICE, [endpoint(pod, ready=True)], port=pod.port))
        args = RouterArgs(
            service_discovery=True, namespace=NS, service_name=SERVICE, health_interval_s=0.3, discovery_relist_s=5
        )
        router = stack.enter_context(ServerThread(create_app(args)))
        async with httpx.AsyncClient(timeout=10) as client:

            async def workers() -> dict[str, dict[str, Any]]:
                return {w["url"]: w for w in (await client.get(router + "/health")).json()["workers"]}

            async def routable(urls: set[str]) -> bool:
                ws = await workers()
                return set(ws) == urls and all(w["state"] == "healthy" for w in ws.values())

            deadline = time.monotonic() + 30
            while not await routable({p.url for p in old}):
                assert time.monotonic() < deadline, await workers()
                await asyncio.sleep(0.05)
            load = Load(router)
            running = asyncio.get_running_loop().create_task(load.run())
            await wait(lambda: len(load.outcomes) >= 4, 20, "streams under way")

            new: list[Pod] = []
            for i, gone in enumerate(old):
                # Surge: the new pod starts, then its readiness probe passes.
                pod = start(new_pod(f"{SERVICE}-new-{i}"))
                new.append(pod)
                await create(emulator, make_slice(pod.name, SERVICE, [endpoint(pod, ready=False)], port=pod.port))
                await asyncio.sleep(0.2)
                await patch(emulator, pod.name, {"endpoints": [endpoint(pod, ready=True)]})
                # maxUnavailable 0: an old pod goes once the new one is ready (and routable here, for the check below).
                urls = {p.url for p in old[i:]} | {p.url for p in new}
                deadline = time.monotonic() + 20
                while not await routable(urls):
                    assert time.monotonic() < deadline, await workers()
                    await asyncio.sleep(0.05)
                # Deleted: its endpoint turns terminating at once; the kubelet runs preStop, then sends SIGTERM.
                gone.terminated_at = time.monotonic()
                gone.inflight_at_termination = gone.app.inflight
                terminating = endpoint(gone, ready=False, serving=True, terminating=True)
                await patch(emulator, gone.name, {"endpoints": [terminating]})
                deadline = time.monotonic() + pre_stop_s + 5
                while gone.url in await workers():  # the router stops routing to it as soon as it sees that
                    assert time.monotonic() < deadline, "the router still routes to a terminating engine"
                    await asyncio.sleep(0.02)
                await asyncio.sleep(max(0.0, gone.terminated_at + pre_stop_s - time.monotonic()))
                gone.app.begin_drain()  # SIGTERM
                await wait(lambda g=gone: g.app.inflight == 0, grace_s, f"{gone.name} drained within its grace period")
                await delete(emulator, gone.name)  # the pod is gone: its slice goes with it
            # After the rollout: every new request goes to the new engines.
            mark = len(load.outcomes)
            await wait(lambda: len(load.outcomes) >= mark + 8, 20, "streams after the rollout")
            load.stop.set()
            await asyncio.wait_for(running, 30)

    bad = [o for o in load.outcomes if o[1] != "ok"]
    assert not bad, f"{len(bad)} of {len(load.outcomes)} streams lost: {bad[:5]}"
    for pod in old:
        assert pod.inflight_at_termination > 0, f"{pod.name} had no stream in flight to drain"
        assert pod.app.refused == 0, f"{pod.name} refused requests the router sent after SIGTERM"
    assert {w for w, _ in load.outcomes[mark:]} <= {p.url for p in new}
    assert all(p.app.served > 0 for p in new)
