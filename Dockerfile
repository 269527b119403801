# One image for every rollstream tier, the example trainer and the tools.
#   docker build -t rollstream .                      # on python:3.11-slim, CPU torch (small image)
#   docker build --build-arg BASE_IMAGE=local/debian:bookworm -t rollstream .
#                                                     # on a local Debian base (scripts/images.sh)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 -t rollstream .
# BASE_IMAGE is any Debian-like image: with Python 3.11+ it is used, else Debian's python3 is
# installed (deploy/images/python-venv.sh). Everything Python lives in the venv /opt/venv.
# SGLang and vLLM are NOT in this image: they run in their own containers and the rollout
# workers talk to them over HTTP.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
LABEL org.rollstream.image=rollstream

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

WORKDIR /app
COPY deploy/images/python-venv.sh /usr/local/bin/
RUN python-venv.sh /opt/venv

# torch first, from the chosen index: the largest layer, rebuilt only when the index changes.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch

# The package's dependencies before its source: a change of the source reinstalls only the
# package (seconds), a change of pyproject.toml the dependencies.
COPY pyproject.toml ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + [d for x in ("math", "plot", "vision") for d in p["optional-dependencies"][x]]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# Built from /src, which goes: a rollstream/ folder on PYTHONPATH (/app) would hide the
# installed package, whose tiers (rollstream.producers, ...) come from the tier folders.
COPY README.md pyproject.toml /src/
COPY rollstream /src/rollstream
COPY producers /src/producers
COPY rollout_workers /src/rollout_workers
COPY reward_workers /src/reward_workers
COPY consumers /src/consumers
RUN pip install --no-deps /src && rm -rf /src && rollstream --help >/dev/null \
    && python -c 'import rollstream.producers, rollstream.rollout_workers, rollstream.reward_workers, rollstream.consumers'
COPY examples ./examples

# Run as an unprivileged user; /data is where the compose volume (dumps, checkpoints, demo
# assets, HF cache) is mounted, created here so that the volume inherits the ownership.
RUN useradd --create-home --uid 1000 rollstream \
    && mkdir -p /data \
    && chown rollstream:rollstream /data
USER rollstream

# examples/ is importable through PYTHONPATH=/app and found in the working directory
# (`rollstream train` runs examples/grpo_trainer.py).
CMD ["rollstream", "--help"]
