"""engine/cpu_threads.py: CPU lists, when auto binds, and a real pinning of an OpenMP team in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from radixserve.engine.config import EngineArgs, validate_engine_args
from radixserve.engine.cpu_threads import parse_cpu_list, resolve_bind
from radixserve.launch.local_stack import engine_argv, engine_cpu_sets

from conftest import ROOT


def test_cpu_lists_parse_as_linux_cpusets():
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    assert parse_cpu_list("3") == [3]
    for bad in ("", "a", "1-", "2-1", "0,0", "0-1,1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_auto_binds_only_when_the_threads_own_every_allowed_cpu():
    allowed = sorted(os.sched_getaffinity(0))
    assert resolve_bind("auto", len(allowed)) == allowed
    assert resolve_bind("auto", len(allowed) + 1) is None
    assert resolve_bind("nobind", len(allowed)) is None
    assert resolve_bind(str(allowed[0]), 1) == [allowed[0]]
    with pytest.raises(ValueError, match="names 1 CPUs for 2 threads"):
        resolve_bind(str(allowed[0]), 2)
    with pytest.raises(ValueError, match="may only run on"):
        resolve_bind("4095", 1)


def test_a_bad_bind_value_is_a_flag_error():
    with pytest.raises(ValueError, match="--cpu-omp-threads-bind"):
        validate_engine_args(EngineArgs(cpu_omp_threads_bind="zero"))


def test_up_gives_each_engine_its_own_cpus():
    allowed = sorted(os.sched_getaffinity(0))
    n = len(allowed)
    assert engine_cpu_sets("auto", n, 1) == [str(c) for c in allowed]
    assert engine_cpu_sets("auto", 1, n) == [",".join(map(str, allowed))]
    assert engine_cpu_sets("auto", n + 1, 1) == ["nobind"] * (n + 1)  # they do not fit: no pinning at all
    assert engine_cpu_sets("nobind", 2, 1) == ["nobind", "nobind"]
    argv = engine_argv(EngineArgs(), 30000, 1, "1")
    assert argv[argv.index("--cpu-omp-threads-bind") + 1] == "1"


_PIN = textwrap.dedent(
    """
    import json, os, threading
    import torch
    from radixserve.engine.cpu_threads import bind_omp_threads
    out = {}
    def run():
        placement = bind_omp_threads(sorted(os.sched_getaffinity(0))[:2])
        torch.randn(1 << 20).mul_(2.0)  # the team runs again and keeps its pinning
        out["placement"] = {str(t): c for t, c in placement.items()}
        out["affinity"] = {str(t): sorted(os.sched_getaffinity(t)) for t in placement}
        out["threads"] = torch.get_num_threads()
    t = threading.Thread(target=run)
    t.start(); t.join()
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_the_engine_thread_and_its_openmp_team_are_pinned_one_per_cpu():
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    done = subprocess.run([sys.executable, "-c", _PIN], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert out["threads"] == 2
    assert sorted(out["placement"].values()) == cpus  # the engine thread and one OpenMP worker
    for tid, cpu in out["placement"].items():
        assert out["affinity"][tid] == [cpu]
