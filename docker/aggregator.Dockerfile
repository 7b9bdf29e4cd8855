# syntax=docker/dockerfile:1
# hsbn-aggregator: the node (sidecar) and root aggregator, one image for both roles.
#
#   docker build -f docker/aggregator.Dockerfile -t hsbn/aggregator:0.1.0 .
#   docker run --rm -v hsbn-run:/run/hsbn hsbn/aggregator:0.1.0                 # a sidecar
#   docker run --rm -p 7070:7070 hsbn/aggregator:0.1.0 --role=root \
#       --listen=0.0.0.0:7070 --id=root --ready-file=/run/hsbn/ready              # the root
#
# The build stage runs scripts/setup.sh, the same script developers and CI run, so the image
# is built exactly as the tree is tested. The runtime stage installs only the Debian packages
# that own the libraries the binary links (docker/runtime-deps.sh reads them off the binary).
ARG DEBIAN_IMAGE=debian:12.8
ARG DEBIAN_SLIM_IMAGE=debian:12.8-slim

FROM ${DEBIAN_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY . .
RUN ./scripts/setup.sh
RUN docker/runtime-deps.sh packages build/server/hsbn-aggregator > /runtime-packages.txt

FROM ${DEBIAN_SLIM_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update \
 && xargs --arg-file=/tmp/runtime-packages.txt apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt
RUN groupadd --system --gid 10001 hsbn \
 && useradd --system --uid 10001 --gid hsbn --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin hsbn \
 && install -d -o hsbn -g hsbn -m 0750 /run/hsbn
COPY --from=build /src/build/server/hsbn-aggregator /usr/local/bin/hsbn-aggregator
USER 10001:10001
# The root's gRPC port; sidecars listen on the Unix socket in /run/hsbn (share that volume).
EXPOSE 7070
VOLUME ["/run/hsbn"]
STOPSIGNAL SIGTERM
# Healthy once the aggregator has written its ready file (it is listening).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["test", "-f", "/run/hsbn/ready"]
ENTRYPOINT ["/usr/local/bin/hsbn-aggregator"]
CMD ["--role=node", "--listen=unix:/run/hsbn/hsbn.sock", "--ready-file=/run/hsbn/ready"]
