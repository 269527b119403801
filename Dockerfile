# One image for every rollstream tier, the example trainer and the tools.
#   docker build -t rollstream .                      # CPU torch (small image)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 -t rollstream .
# SGLang is NOT in this image: it runs in its own container (lmsysorg/sglang) and the rollout
# workers talk to it over HTTP.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app

# torch first, from the chosen index: the largest layer, rebuilt only when the index changes.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch

COPY pyproject.toml README.md ./
COPY rollstream ./rollstream
COPY producers ./producers
COPY rollout_workers ./rollout_workers
COPY reward_workers ./reward_workers
COPY consumers ./consumers
COPY examples ./examples
RUN pip install ".[math,plot,vision]"

# Run as an unprivileged user; /data is where the compose volume (dumps, checkpoints, demo
# assets, HF cache) is mounted, created here so that the volume inherits the ownership.
RUN useradd --create-home --uid 1000 rollstream \
    && mkdir -p /data \
    && chown rollstream:rollstream /data
USER rollstream

# examples/ is importable through PYTHONPATH=/app (`rollstream train` runs its trainer).
CMD ["rollstream", "--help"]
