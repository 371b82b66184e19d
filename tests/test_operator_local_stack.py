"""The operator's children really serve, without a cluster: the test plays kubelet and the EndpointSlice and
Deployment controllers (which the API emulator lacks) and runs the REAL engine and router processes from the command
lines the operator rendered.

The operator (kopf, against tests/k8s_emulator.py) reconciles a demo InferenceService; the engine Deployment's
container args start `radixserve engine` (the model path mapped from the image's DEMO_MODEL_IMAGE_DIR to this
checkout's models/, host/port moved to a free local port); an EndpointSlice for the engine Service is written as the
EndpointSlice controller would (the Service's labels plus kubernetes.io/service-name, port named http); the router
Deployment's args start `radixserve router --service-discovery ...` against the emulator; the official openai client
talks to the router; Deployment status written as the Deployment controller would turns the InferenceService Ready.
What this cannot show: images, scheduling, probes run by a kubelet, garbage collection (e2e/kind.sh does, with Docker).
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from radixserve.contracts import constants

from conftest import MODEL_DIR, free_port, requires_model
from k8s_emulator import k8s  # noqa: F401 - pytest fixture
from operator_scenario import NS, OperatorHarness, child_path, isvc_body, isvc_path, until

NAME = "demo"
SPEC = {
    "model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}", "contextLength": 2048},
    "engine": {"kvCacheTokens": 8192, "dtype": "float32", "resources": {"limits": {"cpu": "1", "memory": "3Gi"}}},
    "replicas": 1,
}

# The same with API keys from Secrets (issue 11: keys were only possible in plain-text args).
CLIENT_KEY, ENGINE_KEY = "sk-client-4b1d", "sk-engine-e07a"
SECURED_SPEC = {
    **SPEC,
    "engine": {**SPEC["engine"], "apiKeySecretRef": {"name": "demo-engine-key"}},
    "router": {"apiKeySecretRef": {"name": "demo-api-key"}},
}
SECRETS = {"demo-api-key": CLIENT_KEY, "demo-engine-key": ENGINE_KEY}

pytestmark = [pytest.mark.slow, requires_model, pytest.mark.asyncio, pytest.mark.timeout(300)]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def _as_local_process(container: dict[str, Any], port: int) -> list[str]:
    """The container's command line as a local process: the image's paths mapped to this checkout, listening on
    127.0.0.1:``port`` (appended flags win: argparse keeps the last)."""
    assert container["command"] == ["radixserve"]
    args = [MODEL_DIR if a == constants.DEMO_MODEL_IMAGE_DIR else a for a in container["args"]]
    return [sys.executable, "-m", "radixserve", *args, "--host", "127.0.0.1", "--port", str(port)]


async def _kubelet_env(h: OperatorHarness, container: dict[str, Any]) -> dict[str, str]:
    """The environment the kubelet gives ``container``: this process's, minus any RADIXSERVE_ variables, plus the
    container's ``env``: values as given, secretKeyRefs read from the Secrets in the emulated API server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    for var in container.get("env", []):
        if "value" in var:  # a plain value (RADIXSERVE_SHUTDOWN_TIMEOUT, the graceful drain's bound)
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]["secretKeyRef"]
        secret = await h.get(child_path("v1", "secrets", ref["name"]))
        assert secret is not None, f"Secret {ref['name']} missing: the pod would be CreateContainerConfigError"
        env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


def _spawn(argv: list[str], log_path: str, env: dict[str, str]) -> subprocess.Popen:
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _http_ok(
    client: httpx.AsyncClient, url: str, proc: subprocess.Popen, log_path: str, timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process exited {proc.returncode}: {open(log_path).read()[-3000:]}"
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)
    pytest.fail(f"{url} never answered 200: {open(log_path).read()[-3000:]}")


def _endpoint_slice(service: dict[str, Any], port: int, pod: str) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it for ``service`` and one ready pod."""
    labels = {
        **service["metadata"]["labels"],
        constants.LABEL_SERVICE_NAME: service["metadata"]["name"],
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    }
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": f"{service['metadata']['name']}-x7k2p", "namespace": NS, "labels": labels},
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": NS},
            }
        ],
        "ports": [{"name": constants.HTTP_PORT_NAME, "port": port, "protocol": "TCP"}],
    }


def _available(deployment: dict[str, Any]) -> dict[str, Any]:
    """The status the Deployment controller writes once every replica of the current generation is available."""
    n = deployment["spec"]["replicas"]
    return {
        "status": {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            "replicas": n,
            "updatedReplicas": n,
            "readyReplicas": n,
            "availableReplicas": n,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
            ],
        }
    }


@pytest.mark.parametrize("secured", [False, True], ids=["open", "keys-from-secrets"])
async def test_rendered_engine_and_router_serve_openai_through_engine_service_discovery(
    k8s,  # noqa: F811
    tmp_path,
    secured,
):
    from openai import AsyncOpenAI, AuthenticationError

    emulator, api = k8s
    h = OperatorHarness(emulator, api)
    await h.start(resync_seconds=1.0)
    procs: list[subprocess.Popen] = []
    try:
        if secured:
            for name, value in SECRETS.items():
                secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}}
                data = {"api-key": base64.b64encode(value.encode()).decode()}
                await h.create(child_path("v1", "secrets"), {**secret, "type": "Opaque", "data": data})
        await h.create(isvc_path(), isvc_body(NAME, SECURED_SPEC if secured else SPEC))
        engine_dep_path = child_path("apps/v1", "deployments", constants.engine_deployment_name(NAME))
        router_dep_path = child_path("apps/v1", "deployments", constants.router_deployment_name(NAME))
        engine_svc_path = child_path("v1", "services", constants.engine_deployment_name(NAME))
        engine_dep = await until(lambda: h.get(engine_dep_path), what="engine Deployment")
        router_dep = await until(lambda: h.get(router_dep_path), what="router Deployment")
        engine_svc = await until(lambda: h.get(engine_svc_path), what="engine Service")

        # kubelet: the engine pod.
        engine_port, engine_log = free_port(), str(tmp_path / "engine.log")
        engine_c = _container(engine_dep)
        procs.append(_spawn(_as_local_process(engine_c, engine_port), engine_log, await _kubelet_env(h, engine_c)))
        async with httpx.AsyncClient(timeout=10) as client:
            await _http_ok(
                client, f"http://127.0.0.1:{engine_port}{constants.ENGINE_HEALTH_PATH}", procs[0], engine_log
            )
            # EndpointSlice controller: the ready engine pod behind the engine Service.
            await h.create(
                f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                _endpoint_slice(engine_svc, engine_port, pod=f"{engine_dep['metadata']['name']}-abc12"),
            )

            # kubelet: the router pod, discovering engines through the emulated API server ($KUBECONFIG).
            router_port, router_log = free_port(), str(tmp_path / "router.log")
            router_c = _container(router_dep)
            router_env = await _kubelet_env(h, router_c)
            procs.append(_spawn(_as_local_process(router_c, router_port), router_log, router_env))
            router = f"http://127.0.0.1:{router_port}"
            await _http_ok(client, router + constants.ROUTER_READY_PATH, procs[1], router_log)
            # The path the rendered probes use answers without a key.
            probe = router_c["readinessProbe"]["httpGet"]["path"]
            assert (await client.get(router + probe)).status_code == 200
            if secured:  # the engine refuses a pod that calls it without its key; the router (ready) has it
                unauth = await client.get(f"http://127.0.0.1:{engine_port}/v1/models")
                assert unauth.status_code == 401, unauth.text

        # An application team's client, pointed at the router.
        if secured:
            wrong = AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=30)
            with pytest.raises(AuthenticationError):
                await wrong.models.list()
        key = CLIENT_KEY if secured else "none"
        oai = AsyncOpenAI(base_url=router + "/v1", api_key=key, max_retries=0, timeout=120)
        reply = await oai.chat.completions.with_raw_response.create(
            model=constants.DEMO_MODEL_NAME,
            max_tokens=8,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert reply.headers[constants.HEADER_WORKER] == f"http://127.0.0.1:{engine_port}"
        completion = reply.parse()
        assert completion.choices[0].message.content and completion.usage.completion_tokens > 0
        models = await oai.models.list()
        assert [m.id for m in models.data] == [constants.DEMO_MODEL_NAME]

        # Deployment controller: both Deployments available -> the InferenceService is Ready with its URL.
        for path in (engine_dep_path, router_dep_path):
            await h.patch(path + "/status", _available(await h.get(path)))

        async def ready() -> dict[str, Any] | None:
            obj = await h.isvc(NAME)
            conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
            return obj if conds.get("Ready", {}).get("status") == "True" else None

        obj = await until(ready, timeout=30, what="InferenceService Ready")
        assert obj["status"]["url"] == f"http://{NAME}.{NS}.svc.cluster.local"
        assert obj["status"]["readyReplicas"] == 1 and obj["status"]["modelName"] == constants.DEMO_MODEL_NAME
    finally:
        for proc in procs:
            _stop(proc)
        await h.stop()
