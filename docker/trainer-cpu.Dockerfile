# syntax=docker/dockerfile:1
# A CPU trainer image from Debian packages alone: Debian 12's PyTorch (python3-torch, 1.13) and
# hsbn's wheel. The CPU twin of trainer.Dockerfile (CUDA, PyTorch from pip): no GPU, no download
# outside Debian's archive, about a third of its size. Add your training script on top
# (FROM hsbn/trainer-cpu:0.1.0, COPY train.py /workspace/).
#
#   docker build -f docker/trainer-cpu.Dockerfile -t hsbn/trainer-cpu:0.1.0 .
#   podman build --format docker -f docker/trainer-cpu.Dockerfile -t hsbn/trainer-cpu:0.1.0 .
#
# The build stage is the aggregator image's build stage, line for line (tests/deploy checks
# that they match). scripts/containers.sh builds this image without compiling again: it passes
# the tree's built wheel as the build stage (--build-context build=DIR, docs/DEPLOY.md).
ARG DEBIAN_IMAGE=debian:12.8

FROM ${DEBIAN_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY . .
RUN ./scripts/setup.sh

FROM ${DEBIAN_IMAGE} AS trainer
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-torch python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/build/dist/ /opt/hsbn/dist/
# A venv that sees Debian's torch and numpy (--system-site-packages) and holds hsbn's wheel.
# Debian's /usr/bin/torchrun runs /usr/bin/python3, whose workers would not see the venv: the
# venv gets a torchrun of its own (torchrun is torch.distributed.run).
RUN python3 -m venv --system-site-packages /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps /opt/hsbn/dist/hsbn-*.whl \
 && printf '#!/bin/sh\nexec /opt/venv/bin/python3 -m torch.distributed.run "$@"\n' > /opt/venv/bin/torchrun \
 && chmod 0755 /opt/venv/bin/torchrun
RUN groupadd --gid 10001 trainer \
 && useradd --uid 10001 --gid trainer --create-home --shell /bin/bash trainer \
 && install -d -o trainer -g trainer /workspace
ENV PATH=/opt/venv/bin:${PATH} \
    HSBN_ADDRESS=unix:/run/hsbn/hsbn.sock \
    PYTHONUNBUFFERED=1
WORKDIR /workspace
USER 10001:10001
# A trainer is a batch process with no port to probe; its pod's sidecar carries the health.
HEALTHCHECK NONE
ENTRYPOINT ["torchrun"]
CMD ["--help"]
