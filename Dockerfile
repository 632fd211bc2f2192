# The vgpu device plugin daemon: one pod per GPU node (see daemonset/).
#
#   podman build -t registry.example.com/vgpu-device-plugin:0.1.0 .     (or docker build)
#
# BASE_IMAGE is taken by digest, so that a build today and a build next month start from the same
# bytes; move it on with `skopeo inspect --format '{{.Digest}}' docker://python:3.11-slim-bookworm`
# (the digest of the multi-architecture index). Another base (--build-arg BASE_IMAGE=...) needs
# python3 3.11 or newer with the venv module; both stages use it, so the virtual environment's
# interpreter is the one the final image runs.
#
# The dependencies come from requirements.lock, every file pinned by its sha256 (pip
# --require-hashes); tools/lock_requirements.sh writes it from pyproject.toml and CI checks that
# it is current. The package index is pip's default unless the PIP_* build arguments below say
# otherwise (tools/image_test.sh passes the host's).
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

# --- stage 1: build the wheel of this project (no dependencies) ---------------------------------
FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
ARG PIP_DEFAULT_TIMEOUT=60
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deviceplugin ./deviceplugin
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- stage 2: the runtime hook, a static binary the node's OCI runtime runs -----------------------
# deviceplugin/hook/vgpu-hook.c (docs/design.md §15): static, so that it needs nothing on the
# host. The compiler stays in this stage; the final image gets the binary alone.
FROM ${BASE_IMAGE} AS hook
# Debian's compiler of the base image's release: the versions move with its security updates.
# hadolint ignore=DL3008
RUN --mount=type=bind,source=deviceplugin/hook,target=/src/hook \
    apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /out \
    && gcc -static -Os -s -std=c11 -Wall -Wextra -Werror -o /out/vgpu-hook /src/hook/vgpu-hook.c \
    && /out/vgpu-hook --version

# --- stage 3: the runtime, a virtual environment with the wheel and its dependencies ------------
FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
ARG PIP_DEFAULT_TIMEOUT=60
LABEL org.opencontainers.image.title="vgpu-device-plugin" \
      org.opencontainers.image.description="Kubernetes device plugin that slices GPUs into memory and compute shares and enforces them" \
      org.opencontainers.image.source="https://github.com/vgpu/vgpu-device-plugin" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
# The locked dependencies first, each file checked against its hash; then the wheel, with no
# dependency resolution of its own; then the runtime hook, which the daemon puts on the host.
# All come in through bind mounts: no copy stays in a layer.
RUN --mount=type=bind,source=requirements.lock,target=/tmp/requirements.lock \
    --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=hook,source=/out,target=/hook \
    python3 -m venv /opt/vgpu \
    && /opt/vgpu/bin/pip install --no-cache-dir --disable-pip-version-check \
        --require-hashes --only-binary=:all: -r /tmp/requirements.lock \
    && /opt/vgpu/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps \
        /wheels/*.whl \
    && /opt/vgpu/bin/pip check \
    && install -D -m 0755 /hook/vgpu-hook /opt/vgpu/libexec/vgpu-hook
# The root filesystem is read-only in the DaemonSet: no byte-code is written at run time (pip
# compiled it at install), and log lines are not held in a buffer.
ENV PATH="/opt/vgpu/bin:${PATH}" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["vgpu-device-plugin"]
CMD ["serve"]
