# pdserve's image, for CPU or CUDA nodes (one Dockerfile, a build argument):
#
#   docker build -t pdserve:cpu .                                  # CPU (the default)
#   docker build -t pdserve:cuda --build-arg TORCH_VARIANT=cu128 .  # CUDA 12.8 wheels
#
#   docker run --rm -p 8000:8000 pdserve:cpu                        # the demo model
#   docker run --rm -p 8000:8000 -e PDSERVE_API_KEY="$(cat key)" pdserve:cpu  # with a key
#
# The default command binds 0.0.0.0 with no API key: the router logs a WARNING at
# start-up ("THE API IS OPEN ...") until PDSERVE_API_KEY (or --api-key-file) gives one.
# /admin/* (pdserve scale) and /metrics/targets answer loopback clients only (docker exec)
# unless PDSERVE_ADMIN_API_KEY gives an admin key.
#   docker run --rm -p 8000:8000 -v /models:/models:ro --gpus all pdserve:cuda \
#       pdserve serve --host 0.0.0.0 --model /models/my-checkpoint
#
# TORCH_VARIANT names one of PyTorch's wheel indexes (https://download.pytorch.org/whl/):
# cpu, or a CUDA build such as cu126, cu128 or cu130 that ships for TORCH_VERSION. The
# CUDA wheels carry their own CUDA libraries; the node needs only the NVIDIA driver and
# the container toolkit. The same image serves as the KubeRay head and worker image
# (deploy/kuberay): RAY_VERSION must equal the RayCluster's spec.rayVersion.
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG RAY_VERSION=2.60.0

# g++: the C++ CPU kernels are compiled on first use with -march=native, so they fit the
# node that runs them (kernels/cpu_ext.py), and Triton compiles its launchers at run time.
# libssl-dev: the router's block index (cluster/csrc) hashes with OpenSSL's SHA-256.
# curl: health checks from inside the container.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ libssl-dev curl \
 && rm -rf /var/lib/apt/lists/*

# torch first, from the index of the chosen variant, so that pdserve's `torch>=...` is
# already met and pip never pulls the default (CUDA) build into a CPU image.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
COPY pdserve_pkg ./pdserve_pkg
COPY engine ./engine
COPY kernels ./kernels
COPY kvtransfer ./kvtransfer
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY router ./router
COPY cluster ./cluster
COPY entrypoints ./entrypoints
COPY proto ./proto
RUN pip install --no-cache-dir "ray[default]==${RAY_VERSION}" . \
 && python -c "import pdserve.entrypoints.cli"

# Not root: uid 1000, as in Ray's own images. HOME holds the kernels' build cache and the
# demo model that `pdserve serve` writes when no --model is given.
RUN useradd --create-home --uid 1000 pdserve
USER 1000
WORKDIR /home/pdserve
ENV PYTHONUNBUFFERED=1

# Router HTTP and gRPC. Ray's ports (6379 GCS, 8265 dashboard, 10001 client) are opened
# by the deployment that starts Ray (deploy/kuberay/pdserve.yaml), not here.
EXPOSE 8000 50050
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD curl --fail --silent http://127.0.0.1:8000/health > /dev/null || exit 1
CMD ["pdserve", "serve", "--host", "0.0.0.0"]
