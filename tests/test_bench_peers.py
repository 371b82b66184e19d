"""bench/peers.py: its servers are stopped with everything they spawned, the quiet-machine gate refuses, the client
reads streams and enforces the forced length, and the ratios line judges the issue's targets."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "peers.py"


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_pids(pidfile: Path, n: int) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pidfile.exists() and len(pids := pidfile.read_text().split()) >= n:
            return [int(p) for p in pids[:n]]
        time.sleep(0.05)
    raise AssertionError(f"{pidfile} did not list {n} pids")


def test_stop_server_kills_the_group_and_a_descendant_that_left_it(peers: ModuleType, tmp_path: Path) -> None:
    # A server whose child stays in its group and whose grandchild calls setsid (out of the group), as vLLM's
    # engine-core / worker processes or gcc from a compile could; all must be gone after stop_server.
    pidfile = tmp_path / "pids"
    script = (
        f"sleep 300 & echo $! >> {pidfile}; "
        f"setsid sh -c 'echo $$ >> {pidfile}; exec sleep 300' & "
        "trap '' TERM; while :; do sleep 0.1; done"  # the leader ignores SIGTERM: SIGKILL must follow
    )
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    peers._LIVE[proc.pid] = proc
    children = _wait_pids(pidfile, 2)
    assert all(_alive(p) for p in [proc.pid, *children])
    peers.stop_server(proc, grace_s=0.5)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode is not None
    assert not [p for p in children if _alive(p)]
    assert proc.pid not in peers._LIVE


def test_running_stops_the_server_when_the_measurement_raises(peers: ModuleType, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    spec = peers.ServerSpec(
        name="fake",
        argv=["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"],
        env={},
        url="http://127.0.0.1:9",
        ready=lambda client: pidfile.exists(),
    )
    with pytest.raises(RuntimeError, match="measurement failed"):
        with peers.running(spec, str(tmp_path), timeout_s=10) as (startup, root):
            assert startup >= 0
            pid = _wait_pids(pidfile, 1)[0]
            assert root == pid  # sh exec'd sleep
            rss, peak = peers.tree_memory(root)
            assert 0 < rss <= peak
            raise RuntimeError("measurement failed")
    assert not _alive(pid)
    assert peers.tree_memory(pid) == (0, 0)
    assert (tmp_path / "fake.log").exists()


def test_running_reports_a_server_that_exits_before_ready(peers: ModuleType, tmp_path: Path) -> None:
    spec = peers.ServerSpec("dies", ["sh", "-c", "exit 7"], {}, "http://127.0.0.1:9", lambda client: False)
    with pytest.raises(RuntimeError, match="exited with status 7"):
        with peers.running(spec, str(tmp_path), timeout_s=10):
            pytest.fail("never ready")


def test_cpu_window_leaves_our_own_tree_out(peers: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    ticks = {"busy": 0, "own": 0}
    monkeypatch.setattr(peers, "_busy_ticks", lambda: ticks["busy"])
    monkeypatch.setattr(peers, "_own_ticks", lambda: ticks["own"])
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(peers.time, "monotonic", lambda: next(clock))
    w = peers.CpuWindow().start()
    ticks["busy"], ticks["own"] = 3 * hz, 2 * hz  # 3 core-seconds busy in 2 s, 2 of them ours
    assert w.cores() == pytest.approx(0.5)


def test_wait_quiet_refuses_with_exit_status_3(
    peers: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(peers, "other_cores", lambda window_s=2.0: 0.9)
    with pytest.raises(SystemExit) as exc:
        peers.wait_quiet(0.25, 0.0)
    assert exc.value.code == peers.EXIT_BUSY
    assert "refusing to report" in capsys.readouterr().err
    monkeypatch.setattr(peers, "other_cores", lambda window_s=2.0: 0.1)
    assert peers.wait_quiet(0.25, 0.0) == 0.1


def test_descendants_finds_a_grandchild(peers: ModuleType, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen(["sh", "-c", f"sh -c 'echo $$ > {pidfile}; exec sleep 30' & wait"], start_new_session=True)
    try:
        grandchild = _wait_pids(pidfile, 1)[0]
        assert {os.getpid(), proc.pid, grandchild} <= set(peers.descendants(os.getpid()))
    finally:
        peers.stop_server(proc, grace_s=2)
    assert not _alive(grandchild)


def _sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _fake_chat(completion_tokens: int) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True
        chunks: list[dict[str, Any]] = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}]
        chunks += [{"choices": [{"delta": {"content": f"t{i}"}}]} for i in range(completion_tokens)]
        chunks.append({"choices": [], "usage": {"completion_tokens": completion_tokens, "prompt_tokens": 11}})
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_client_reads_usage_and_enforces_the_forced_length(peers: ModuleType) -> None:
    async def ask(served: int, want: int) -> Any:
        client = peers.Client("http://fake", "m")
        client.http = httpx.AsyncClient(transport=_fake_chat(served))
        try:
            reply = await client.chat([{"role": "user", "content": "hi"}], want)
            peers._check_len([reply], want, "decode")
            return reply
        finally:
            await client.close()

    reply = asyncio.run(ask(5, 5))
    assert (reply.completion_tokens, reply.prompt_tokens) == (5, 11)
    assert reply.ttft_s >= 0 and reply.span_s >= 0
    with pytest.raises(RuntimeError, match=r"exactly 8 completion tokens, got \[5\]"):
        asyncio.run(ask(5, 8))


def test_ratios_and_targets(peers: ModuleType) -> None:
    base = {"wall_s": 10.0, "output_tok_s": 100.0, "mean_ttft_s": 1.0, "decode_tok_s": 30.0, "fresh_ttft_s": 1.0}
    results = {
        "vllm": {**base, "startup_s": 100.0},
        "engine": {**base, "decode_tok_s": 45.0, "fresh_ttft_s": 1.2, "startup_s": 20.0},
        "stack": {**base, "output_tok_s": 140.0, "mean_ttft_s": 0.9, "startup_s": 30.0},
    }
    out = peers.ratios(results)
    assert out["ratios"]["engine"]["decode_tok_s"] == 1.5
    assert out["ratios"]["stack"]["output_tok_s"] == 1.4
    assert out["targets"] == {
        "stack_output_tok_s_ge_1.3x": True,
        "stack_mean_ttft_le_vllm": True,
        "engine_decode_tok_s_ge_1.5x": True,
        "engine_fresh_ttft_le_vllm": False,
    }
    assert peers.ratios({"engine": results["engine"]})["ratios"] is None


def test_q4_targets_over_llamacpp_and_vllm(peers: ModuleType) -> None:
    base = {"wall_s": 10.0, "output_tok_s": 40.0, "mean_ttft_s": 5.0, "decode_tok_s": 90.0, "fresh_ttft_s": 1.0}
    results = {
        "vllm": {**base, "output_tok_s": 100.0, "rss_mib": 3000.0},
        "llamacpp": {**base, "rss_mib": 300.0},
        "engine-q4": {**base, "output_tok_s": 160.0, "decode_tok_s": 99.0, "rss_mib": 500.0, "kv_pool_mib": 150.0},
    }
    out = peers.ratios(results)
    assert out["over_llamacpp"]["engine-q4"]["output_tok_s"] == 4.0
    assert out["targets_q4"] == {
        "q4_decode_tok_s_ge_1.0x_llamacpp": True,
        "q4_output_tok_s_ge_3x_llamacpp": True,
        "q4_rss_le_llamacpp_plus_kv_pool": False,  # 500 > 300 + 150
        "q4_output_tok_s_ge_1.5x_vllm": True,
    }
    no_vllm = peers.ratios({k: v for k, v in results.items() if k != "vllm"})
    assert no_vllm["ratios"] is None and "q4_output_tok_s_ge_1.5x_vllm" not in no_vllm["targets_q4"]


def test_vllm_dtype_follows_avx512_bf16(peers: ModuleType) -> None:
    assert peers.vllm_dtype("auto", {"avx512_bf16": True}) == "bfloat16"
    assert peers.vllm_dtype("auto", {"avx512_bf16": False}) == "float32"
    assert peers.vllm_dtype("bfloat16", {"avx512_bf16": False}) == "bfloat16"
