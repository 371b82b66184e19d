"""``radixserve operator``: flags, refusals, and the real process against the API server emulator (KUBECONFIG)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from radixserve.contracts import constants
from radixserve.launch.cli import main

from conftest import free_port
from k8s_emulator import k8s  # noqa: F401 - pytest fixture
from operator_scenario import OperatorHarness, child_path, isvc_body, isvc_path, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_lists_the_flags():
    out = subprocess.run(
        [sys.executable, "-m", "radixserve", "operator", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in (
        "--namespace",
        "--all-namespaces",
        "--image",
        "--image-pull-policy",
        "--resync-seconds",
        "--metrics-port",
        "--log-level",
        "/healthz",
        "/metrics",
    ):
        assert flag in out.stdout, flag
    assert f"{constants.IMAGE_REPOSITORY}:" in out.stdout and str(constants.OPERATOR_METRICS_PORT) in out.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "one of the arguments --namespace/-n --all-namespaces/-A is required"),
        (["--all-namespaces", "--namespace", "ml"], "not allowed with argument"),
        (["--all-namespaces", "--image-pull-policy", "Sometimes"], "invalid choice: 'Sometimes'"),
        (["--all-namespaces", "--resync-seconds", "soon"], "invalid float value"),
        (["--all-namespaces", "--resync-seconds", "0"], "--resync-seconds must be > 0"),
        (["--all-namespaces", "--metrics-port", "70000"], "--metrics-port must be 0..65535"),
        (["--all-namespaces", "--log-level", "loud"], "invalid choice: 'loud'"),
        (["--all-namespaces", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc_info:
        code = main(["operator", *argv])
        raise SystemExit(code)
    assert exc_info.value.code == 2
    assert message in capsys.readouterr().err


def _env_without_credentials(kubeconfig: str | None, home: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
    }
    env["HOME"] = home
    if kubeconfig is not None:
        env["KUBECONFIG"] = kubeconfig
    return env


@pytest.mark.parametrize("case", ["missing", "garbage"])
def test_no_usable_kubeconfig_is_one_line_and_exit_2(case, tmp_path):
    """Regression: with no kubeconfig (or a garbage one) `radixserve operator -A` printed a 44-95 line traceback
    and exited 1."""
    if case == "missing":
        env, path = _env_without_credentials(None, str(tmp_path)), str(tmp_path / ".kube" / "config")
    else:
        path = str(tmp_path / "kubeconfig")
        with open(path, "w") as f:
            f.write("%%% this is: [not a kubeconfig\n")
        env = _env_without_credentials(path, str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "radixserve", "operator", "-A", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("radixserve operator: no Kubernetes credentials") and path in lines[0]
    assert "Traceback" not in out.stderr
    if case == "missing":
        assert "does not exist" in lines[0] and "$KUBECONFIG is not set" in lines[0]
    else:
        assert "from $KUBECONFIG" in lines[0] and "cannot be used" in lines[0]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_process_reconciles_against_the_emulator_and_stops_on_sigterm(k8s):  # noqa: F811
    emulator, api = k8s
    h = OperatorHarness(emulator, api)  # declares the CRD; the operator itself runs in the subprocess
    # A namespaced operator waits until its namespace exists (kopf lists and watches namespaces).
    await h.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
    port = free_port()
    # The k8s fixture points KUBECONFIG at the emulator; the child inherits it (no in-cluster variables).
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "radixserve",
        "operator",
        "--namespace",
        "ml",
        "--image",
        "radixserve:cli",
        "--metrics-port",
        str(port),
        "--resync-seconds",
        "2",
        cwd=ROOT,
        env=dict(os.environ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

            async def healthy() -> bool:
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await until(healthy, timeout=60, what="operator /healthz 200")
            await h.create(isvc_path(), isvc_body("cli"))
            dep = await until(
                lambda: h.get(child_path("apps/v1", "deployments", constants.engine_deployment_name("cli"))),
                timeout=30,
                what="engine Deployment",
            )
            assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "radixserve:cli"
            await until(lambda: h.condition("cli", "Ready"), timeout=30, what="status conditions")
            metrics = (await client.get("/metrics")).text
            assert 'radixserve_operator_reconciles_total{kind="create",result="success"} 1.0' in metrics
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
        output = (await proc.stdout.read()).decode()
        assert code == 0, output
    except AssertionError:
        if proc.returncode is None:
            proc.kill()
        print((await proc.stdout.read()).decode()[-5000:])
        raise
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
