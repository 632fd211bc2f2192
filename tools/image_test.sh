#!/usr/bin/env bash
# Build the container image from the Dockerfile and run it as the DaemonSet does.
#
#   tools/image_test.sh            (as root; CI runs it from .ci/run)
#
# 1. Makes a base image with no registry: a Debian bookworm rootfs (debootstrap, minbase, with
#    python3, python3-venv, python3-pip, ca-certificates), cached as a tarball under
#    $VGPU_IMAGE_TEST_CACHE (default /var/cache/vgpu-image-test), imported with `podman import`,
#    plus this machine's CA certificates so that pip in the build trusts the same TLS as the host.
# 2. Builds the Dockerfile with --build-arg BASE_IMAGE=<that image> and the host's pip index
#    settings (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST: environment first, then
#    `pip config`; file:// indexes are left out, the build cannot see them).
# 3. Runs `serve` on the fake backend in the container with the DaemonSet's settings: host PID
#    namespace, the device-plugin and pod-resources directories and the state directory
#    bind-mounted (and NFD's features.d, for the node-label file), daemonset/base/config.yaml as
#    the config, a read-only root filesystem, every
#    capability dropped but the DaemonSet's, no privilege escalation. On the host side,
#    tools/image_test_driver.py serves the kubelet simulator in those directories and checks the
#    registration, Allocate for two pods, the capabilities at work, /healthz and /metrics (set
#    VGPU_IMAGE_TEST_METRICS=optional for a build that does not serve them), and a clean stop
#    (exit 0, its socket removed).
#
# Needs root, podman, runc and debootstrap (installed with apt-get when missing), and .venv with
# the project installed (.ci/run makes it). Exits non-zero with a line saying what failed.
# Everything it starts or makes is removed on exit, except the cached rootfs tarball.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

PYTHON=${PYTHON:-$REPO/.venv/bin/python}
CACHE_DIR=${VGPU_IMAGE_TEST_CACHE:-/var/cache/vgpu-image-test}
SUITE=bookworm
PACKAGES=python3,python3-venv,python3-pip,ca-certificates
ROOTFS_TAR=$CACHE_DIR/$SUITE-minbase-python3.tar
RUN_ID=$$-$(date +%s)
BASE_RAW=localhost/vgpu-image-test/rootfs:$RUN_ID
BASE=localhost/vgpu-image-test/base:$RUN_ID
IMAGE=localhost/vgpu-image-test/vgpu-device-plugin:$RUN_ID
CONTAINER=vgpu-image-test-$RUN_ID
# crun refuses the hybrid cgroup layout of these machines, and root cannot raise resource limits
# here, so every container gets runc and limits within the current ones.
PODMAN=(podman --runtime runc)
ULIMITS=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
# The DaemonSet's capabilities (daemonset/base/daemonset.yaml says why each is needed).
CAPABILITIES=(--cap-drop ALL --cap-add KILL --cap-add SYS_PTRACE --cap-add DAC_READ_SEARCH)

started=$SECONDS
step() { echo "== [$((SECONDS - started))s] $*"; }
fail() {
    echo "image test: FAILED: $*" >&2
    exit 1
}

WORK=""
cleanup() {
    local rc=$?
    set +e
    if podman container exists "$CONTAINER" 2>/dev/null; then
        if [ "$rc" -ne 0 ]; then
            echo "-- container log:" >&2
            podman logs "$CONTAINER" >&2 2>&1 | tail -50 >&2
        fi
        "${PODMAN[@]}" rm -f -t 5 "$CONTAINER" >/dev/null 2>&1
    fi
    for image in "$IMAGE" "$BASE" "$BASE_RAW"; do
        podman image exists "$image" 2>/dev/null && podman rmi -f "$image" >/dev/null 2>&1
    done
    # The build stage's image, left untagged by the multi-stage build.
    podman images -q --filter "label=io.vgpu.image-test=$RUN_ID" 2>/dev/null |
        xargs -r podman rmi -f >/dev/null 2>&1
    [ -n "$WORK" ] && rm -rf "$WORK"
    if [ "$rc" -eq 0 ]; then
        echo "image test: passed in $((SECONDS - started))s"
    else
        echo "image test: FAILED after $((SECONDS - started))s" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- tools ----------------------------------------------------------------------------------------
[ "$(id -u)" -eq 0 ] || fail "needs root (podman with the host PID namespace, debootstrap)"
[ -x "$PYTHON" ] || fail "no $PYTHON: make the venv first (.ci/run does)"
missing=()
for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    step "installing ${missing[*]}"
    command -v apt-get >/dev/null || fail "missing ${missing[*]} and no apt-get to install them"
    apt-get update -qq >/dev/null || fail "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null ||
        fail "apt-get install podman runc debootstrap failed"
fi

# --- base image -----------------------------------------------------------------------------------
debian_mirror() {
    local uri=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    elif [ -f /etc/apt/sources.list ]; then
        uri=$(awk '/^deb / && $2 ~ /^http/ {print $2; exit}' /etc/apt/sources.list)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

if [ ! -s "$ROOTFS_TAR" ]; then
    mirror=${VGPU_DEBIAN_MIRROR:-$(debian_mirror)}
    step "debootstrap $SUITE ($PACKAGES) from $mirror into $ROOTFS_TAR (once; cached)"
    mkdir -p "$CACHE_DIR"
    rootfs=$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")
    if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$mirror" \
        >"$CACHE_DIR/debootstrap.log" 2>&1; then
        tail -20 "$CACHE_DIR/debootstrap.log" >&2
        rm -rf "$rootfs"
        fail "debootstrap failed (log: $CACHE_DIR/debootstrap.log)"
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner -cf "$ROOTFS_TAR.tmp" .
    mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
    rm -rf "$rootfs"
fi

WORK=$(mktemp -d /tmp/vgit.XXXXXX)
step "importing the base image"
podman import --quiet "$ROOTFS_TAR" "$BASE_RAW" >/dev/null || fail "podman import failed"

# This machine's CA certificates, for pip in the build (a proxy may re-sign TLS).
mkdir -p "$WORK/base/certs"
cp /etc/ssl/certs/ca-certificates.crt "$WORK/base/ca-certificates.crt" ||
    fail "no /etc/ssl/certs/ca-certificates.crt on this machine"
for cert in /usr/local/share/ca-certificates/*.crt; do
    [ -e "$cert" ] && cp "$cert" "$WORK/base/certs/"
done
cat >"$WORK/base/Containerfile" <<EOF
FROM $BASE_RAW
COPY certs/ /usr/local/share/ca-certificates/
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
EOF
"${PODMAN[@]}" build --quiet "${ULIMITS[@]}" --network host -t "$BASE" "$WORK/base" >/dev/null ||
    fail "could not add the CA certificates to the base image"

# --- the image ------------------------------------------------------------------------------------
pip_setting() { # environment first, then pip's own configuration
    local env_name=$1 key=$2 value
    value=${!env_name:-}
    if [ -z "$value" ]; then
        value=$("$PYTHON" -m pip config get "global.$key" 2>/dev/null || true)
    fi
    echo "$value"
}
only_remote() { # keep the http(s) URLs of a space-separated list
    local url kept=()
    for url in $1; do
        case "$url" in http://* | https://*) kept+=("$url") ;; esac
    done
    echo "${kept[*]:-}"
}
build_args=(--build-arg "BASE_IMAGE=$BASE" --build-arg "PIP_CERT=/etc/ssl/certs/ca-certificates.crt")
index_url=$(only_remote "$(pip_setting PIP_INDEX_URL index-url)")
extra_index_url=$(only_remote "$(pip_setting PIP_EXTRA_INDEX_URL extra-index-url)")
trusted_host=$(pip_setting PIP_TRUSTED_HOST trusted-host)
[ -n "$index_url" ] && build_args+=(--build-arg "PIP_INDEX_URL=$index_url")
[ -n "$extra_index_url" ] && build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$extra_index_url")
[ -n "$trusted_host" ] && build_args+=(--build-arg "PIP_TRUSTED_HOST=$trusted_host")
step "building the image (index: ${index_url:-the default}${extra_index_url:+, extra: $extra_index_url})"
if ! "${PODMAN[@]}" build "${ULIMITS[@]}" --network host --layers=false \
    --label "io.vgpu.image-test=$RUN_ID" "${build_args[@]}" -t "$IMAGE" . >"$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log" >&2
    fail "podman build failed"
fi
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
step "built $IMAGE ($((size / 1024 / 1024)) MiB)"

# What must not be in the final image: compilers, pip's cache, the wheel; what must: the runtime
# hook, runnable on its own (static).
# shellcheck disable=SC2016 # the script runs in the container's shell
"${PODMAN[@]}" run --rm "${ULIMITS[@]}" --network none --entrypoint /bin/sh "$IMAGE" -c '
    for tool in gcc cc g++ make; do command -v "$tool" && exit 1; done
    [ ! -e /root/.cache/pip ] && [ ! -e /wheels ] && [ ! -e /src ] && [ ! -e /hook ] || exit 1
    /opt/vgpu/libexec/vgpu-hook --version || exit 1
    vgpu-device-plugin --version' >"$WORK/inspect.log" 2>&1 ||
    { cat "$WORK/inspect.log" >&2; fail "the image has a compiler, a pip cache or build files, or no hook"; }
step "image holds the static hook and no compiler, cache or build files: $(tail -1 "$WORK/inspect.log")"

# NVIDIA's config files are read through libyaml, as NVIDIA's plugin reads them (tab-indented JSON
# included): PyYAML in the image must have its C loader.
"${PODMAN[@]}" run --rm "${ULIMITS[@]}" --network none --entrypoint /opt/vgpu/bin/python "$IMAGE" \
    -c 'import yaml; assert yaml.__with_libyaml__, "PyYAML without libyaml"' \
    >"$WORK/libyaml.log" 2>&1 || { cat "$WORK/libyaml.log" >&2; fail "PyYAML has no libyaml"; }
step "PyYAML in the image has libyaml"

# --- run it as the DaemonSet does -----------------------------------------------------------------
NODE=$WORK/node
mkdir -p "$NODE/device-plugins" "$NODE/pod-resources" "$NODE/state" "$NODE/fake" "$NODE/features.d"
start_cmd=(
    "${PODMAN[@]}" run --detach --name "$CONTAINER" "${ULIMITS[@]}"
    --pid host --network none --user 0:0 --read-only --tmpfs /tmp
    "${CAPABILITIES[@]}" --security-opt no-new-privileges
    --volume "$NODE/device-plugins:/var/lib/kubelet/device-plugins"
    --volume "$NODE/pod-resources:/var/lib/kubelet/pod-resources:ro"
    --volume "$NODE/state:/var/lib/vgpu"
    --volume "$NODE/features.d:/etc/kubernetes/node-feature-discovery/features.d"
    --volume "$NODE/fake:/etc/vgpu/fake:ro"
    --volume "$REPO/daemonset/base/config.yaml:/etc/vgpu/config.yaml:ro"
    --env VGPU_CONFIG=/etc/vgpu/config.yaml
    --env VGPU_BACKEND=fake:/etc/vgpu/fake/gpus.json
    --env NODE_NAME=image-test-node
    --env VGPU_NODE_FEATURES_DIR=/etc/kubernetes/node-feature-discovery/features.d
    --env VGPU_NODE_FEATURES_FILE=vgpu
    "$IMAGE" serve --log-format text
)
stop_cmd=("${PODMAN[@]}" stop --time 30 "$CONTAINER")
exec_cmd=("${PODMAN[@]}" exec "$CONTAINER")
step "running the container against the kubelet simulator on the host"
"$PYTHON" tools/image_test_driver.py --root "$NODE" \
    --start "$(printf '%q ' "${start_cmd[@]}")" \
    --stop "$(printf '%q ' "${stop_cmd[@]}")" \
    --exec "$(printf '%q ' "${exec_cmd[@]}")" \
    --metrics "${VGPU_IMAGE_TEST_METRICS:-required}" ||
    fail "the daemon in the container did not pass the kubelet checks (driver output above)"

exit_code=$(podman inspect --format '{{.State.ExitCode}}' "$CONTAINER")
[ "$exit_code" = "0" ] || fail "the container exited $exit_code on SIGTERM, not 0"
podman logs "$CONTAINER" >"$WORK/daemon.log" 2>&1
for line in "registered with the kubelet" "stopped"; do
    grep -q "$line" "$WORK/daemon.log" || {
        tail -30 "$WORK/daemon.log" >&2
        fail "no '$line' in the daemon's log"
    }
done
step "the container stopped on SIGTERM with exit 0; its log has the registration and the stop"
# The node feature file NFD reads (VGPU_NODE_FEATURES_DIR and _FILE, as the DaemonSet sets
# them), written through the hostPath.
grep -q '^nvidia.com/vgpu.count=' "$NODE/features.d/vgpu" 2>/dev/null ||
    fail "no node feature file with nvidia.com/vgpu.count at $NODE/features.d/vgpu"
step "the node feature file: $(tr '\n' ' ' <"$NODE/features.d/vgpu")"
