# syntax=docker/dockerfile:1
# An example trainer image: CUDA, PyTorch and hsbn's wheel. Add your training script on top
# (FROM hsbn/trainer:0.1.0, COPY train.py /workspace/).
#
#   docker build -f docker/trainer.Dockerfile -t hsbn/trainer:0.1.0 .
#
# The build stage is the aggregator image's build stage, line for line (tests/deploy checks
# that they match): scripts/setup.sh builds everything, including the wheel
# build/dist/hsbn-VERSION-py3-none-linux_x86_64.whl, which carries libhsbn.so, hsbn-aggregator
# and the gRPC/protobuf/Abseil/OpenSSL libraries they need. It runs on the CUDA image's Ubuntu
# (it needs glibc >= 2.34 and GCC 12's libstdc++; Ubuntu 24.04 has 2.39 and GCC 14's).
# tests/package/test_trainer_image.py rebuilds this image's file layout in a folder and checks
# that hsbn finds its library there.
ARG DEBIAN_IMAGE=debian:12.8
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

FROM ${DEBIAN_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY . .
RUN ./scripts/setup.sh

FROM ${CUDA_IMAGE} AS trainer
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION=2.6.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/venv/bin/pip install --no-cache-dir numpy
COPY --from=build /src/build/dist/ /opt/hsbn/dist/
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps /opt/hsbn/dist/hsbn-*.whl
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
