#!/usr/bin/env bash
# End-to-end on a local kind cluster (needs Docker): build the CPU image with the demo model, load it into kind,
# helm install the operator, apply the demo InferenceService, wait Ready, talk OpenAI to the router Service, show
# /metrics, scale the engines with `kubectl scale` (to 1, then back to 2). See e2e/README.md.
#
#   e2e/kind.sh                       # from anywhere; deletes the cluster on exit
#   KEEP_CLUSTER=1 e2e/kind.sh        # keep it (and reuse it next run)
#
# Settings (environment): CLUSTER (kind cluster name), NAMESPACE (of the InferenceService), RELEASE_NAMESPACE (of
# the operator), SAMPLE (InferenceService manifest), LOCAL_PORT (port-forward), READY_TIMEOUT, DOCKER_BUILD_ARGS,
# SKIP_BUILD=1 (image radixserve:VERSION already built), SCALE_TO (engine replicas after the scale-down-to-1 step, default 2),
# KEEP_CLUSTER=1.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER="${CLUSTER:-radixserve-e2e}"
NAMESPACE="${NAMESPACE:-radixserve-e2e}"
RELEASE_NAMESPACE="${RELEASE_NAMESPACE:-radixserve-system}"
SAMPLE="${SAMPLE:-examples/inferenceservice-demo.yaml}"
CHART="charts/radixserve"
LOCAL_PORT="${LOCAL_PORT:-18000}"
READY_TIMEOUT="${READY_TIMEOUT:-900s}"
KEEP_CLUSTER="${KEEP_CLUSTER:-0}"
SKIP_BUILD="${SKIP_BUILD:-0}"
SCALE_TO="${SCALE_TO:-2}"
# Values of src/radixserve/contracts/constants.py (this script runs without the project installed; tests/test_image_e2e_files.py
# checks they agree): IMAGE_REPOSITORY, ROUTER_SERVICE_PORT, ENGINE_PORT; engine_deployment_name(NAME) = NAME-engine.
IMAGE_REPOSITORY="radixserve"
ROUTER_SERVICE_PORT=80
ENGINE_PORT=30000

log() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { printf 'e2e: %s\n' "$*" >&2; exit 1; }
# The first lines of a /metrics text starting with PREFIX; fails when there is none. (No `grep | head` pipe: under
# pipefail, head closing early would fail the script.)
show_metrics() {
  local lines
  lines="$(grep "^$1" <<<"$2" || true)"
  [ -n "$lines" ] || die "no $1 metrics"
  head -n 25 <<<"$lines"
}

missing=()
for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] || die "missing tools: ${missing[*]} (need docker, kind, kubectl, helm v3, curl)"
docker info >/dev/null 2>&1 || die "the docker CLI cannot reach a Docker engine (is the daemon running?)"
[ -d "$CHART" ] || die "$CHART not found"
[ -f "$SAMPLE" ] || die "$SAMPLE not found"

# The first match, without a `sed | head` pipe (head exiting early fails a pipeline under pipefail).
versions="$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' pyproject.toml)"
VERSION="${versions%%$'\n'*}"
[ -n "$VERSION" ] || die "no version in pyproject.toml"
IMAGE="${IMAGE_REPOSITORY}:${VERSION}"

created_cluster=0
pf_pid=""
NAME=""
cleanup() {
  local rc=$?
  [ -z "$pf_pid" ] || kill "$pf_pid" 2>/dev/null || true
  if [ "$rc" -ne 0 ] && [ -n "$NAME" ]; then
    log "FAILED (exit $rc): diagnostics"
    kubectl get risvc,deploy,pods,svc,endpointslices -n "$NAMESPACE" -o wide || true
    kubectl describe "risvc/$NAME" -n "$NAMESPACE" || true
    kubectl logs -n "$NAMESPACE" "deploy/${NAME}-engine" --tail=50 || true
    kubectl logs -n "$NAMESPACE" "deploy/${NAME}-router" --tail=50 || true
    kubectl logs -n "$RELEASE_NAMESPACE" -l app.kubernetes.io/name=radixserve --tail=50 || true
  fi
  if [ "$KEEP_CLUSTER" = "1" ]; then
    log "keeping cluster $CLUSTER (kind delete cluster --name $CLUSTER)"
  elif [ "$created_cluster" = "1" ]; then
    log "deleting cluster $CLUSTER"
    kind delete cluster --name "$CLUSTER" || true
  fi
  exit "$rc"
}
trap cleanup EXIT

log "kind cluster $CLUSTER"
clusters="$(kind get clusters 2>/dev/null || true)"
if grep -qx "$CLUSTER" <<<"$clusters"; then
  echo "reusing existing cluster $CLUSTER"
else
  kind create cluster --name "$CLUSTER" --wait 180s
  created_cluster=1
fi
kubectl config use-context "kind-$CLUSTER" >/dev/null

if [ "$SKIP_BUILD" != "1" ]; then
  log "docker build $IMAGE (CPU, demo model baked in)"
  # shellcheck disable=SC2086  # DOCKER_BUILD_ARGS is a list of flags
  docker build -t "$IMAGE" --build-arg "VERSION=$VERSION" ${DOCKER_BUILD_ARGS:-} -f Dockerfile .
fi
log "kind load $IMAGE"
kind load docker-image "$IMAGE" --name "$CLUSTER"

log "helm install the operator into $RELEASE_NAMESPACE"
helm upgrade --install radixserve "$CHART" \
  --namespace "$RELEASE_NAMESPACE" --create-namespace \
  --set image.repository="$IMAGE_REPOSITORY" --set image.tag="$VERSION" --set image.pullPolicy=Never \
  --wait --timeout 5m
kubectl wait --for=condition=Established crd/inferenceservices.radixserve.io --timeout=60s

log "apply $SAMPLE in $NAMESPACE"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
NAME="$(kubectl apply -n "$NAMESPACE" -f "$SAMPLE" -o jsonpath='{.metadata.name}')"
[ -n "$NAME" ] || die "could not read the InferenceService name from $SAMPLE"
echo "InferenceService $NAME"

log "wait for Ready (model load; first start pulls nothing, the image is loaded)"
kubectl wait -n "$NAMESPACE" --for=condition=Ready "risvc/$NAME" --timeout="$READY_TIMEOUT"
kubectl get -n "$NAMESPACE" risvc "$NAME" -o wide
MODEL="$(kubectl get -n "$NAMESPACE" risvc "$NAME" -o jsonpath='{.status.modelName}')"
[ -n "$MODEL" ] || die "status.modelName is empty"

log "port-forward svc/$NAME $LOCAL_PORT:$ROUTER_SERVICE_PORT"
kubectl port-forward -n "$NAMESPACE" "svc/$NAME" "$LOCAL_PORT:$ROUTER_SERVICE_PORT" >/dev/null 2>&1 &
pf_pid=$!
BASE="http://127.0.0.1:$LOCAL_PORT"
for _ in $(seq 1 30); do
  curl -fsS "$BASE/live" >/dev/null 2>&1 && break  # the port-forward is up
  sleep 1
done
curl -fsS "$BASE/health"; echo

log "GET /v1/models"
models="$(curl -fsS "$BASE/v1/models")"
echo "$models"
grep -q "\"$MODEL\"" <<<"$models" || die "model $MODEL not listed"

log "POST /v1/chat/completions"
body="{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}"
# -D - prints the headers: x-radixserve-worker (the engine pod) and x-radixserve-route-reason.
reply="$(curl -fsS -D - -H 'content-type: application/json' -d "$body" "$BASE/v1/chat/completions")"
echo "$reply"
grep -q '"choices"' <<<"$reply" || die "no choices in the chat completion"

log "POST /v1/chat/completions (stream)"
stream="$(curl -fsS -N -H 'content-type: application/json' -d "${body%\}}, \"stream\": true}" "$BASE/v1/chat/completions")"
echo "$stream"
grep -q '^data: \[DONE\]' <<<"$stream" || die "the stream did not end with data: [DONE]"

PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [ -x "$PY" ] && "$PY" -c 'import openai' 2>/dev/null; then
  log "openai client"
  "$PY" - "$BASE/v1" "$MODEL" <<'EOF'
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused")
r = client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "Say hi."}],
                                   max_tokens=16, temperature=0)
print(repr(r.choices[0].message.content), r.usage)
EOF
fi

log "router /metrics (radixserve_router_*)"
show_metrics radixserve_router_ "$(curl -fsS "$BASE/metrics")"

log "engine /metrics (radixserve_engine_*), from inside an engine pod"
show_metrics radixserve_engine_ "$(kubectl exec -n "$NAMESPACE" "deploy/${NAME}-engine" -- python -c \
  "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$ENGINE_PORT/metrics').read().decode())")"

# Through the scale subresource (what an HPA writes): down to 1 engine, then up to SCALE_TO; the operator copies
# spec.replicas to the engine Deployment and status.readyReplicas follows.
scale_to() {
  log "kubectl scale risvc/$NAME --replicas $1"
  kubectl scale -n "$NAMESPACE" "risvc/$NAME" --replicas "$1"
  kubectl wait -n "$NAMESPACE" "deploy/${NAME}-engine" --for=jsonpath='{.spec.replicas}'="$1" --timeout=120s
  kubectl rollout status -n "$NAMESPACE" "deploy/${NAME}-engine" --timeout="$READY_TIMEOUT"
  kubectl wait -n "$NAMESPACE" "risvc/$NAME" --for=jsonpath='{.status.readyReplicas}'="$1" --timeout=300s
  kubectl get -n "$NAMESPACE" risvc "$NAME" -o wide
}
scale_to 1
scale_to "$SCALE_TO"
# The router discovers the new engine through the headless Service's EndpointSlices.
sleep 5
curl -fsS "$BASE/health"; echo

log "e2e passed"
