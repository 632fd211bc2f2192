#!/usr/bin/env bash
# Write, or check, requirements.lock: the image's runtime dependencies (pyproject.toml's
# [project].dependencies), each pinned to one version with the sha256 of every file PyPI holds
# for it, so that the Dockerfile's `pip install --require-hashes` installs exactly these.
#
#   tools/lock_requirements.sh            # write requirements.lock (keeps the pins it has)
#   tools/lock_requirements.sh --upgrade  # move every pin to the newest version allowed
#   tools/lock_requirements.sh --check    # exit 1 if requirements.lock does not match
#                                         # pyproject.toml (CI runs this)
#
# pip-compile (pip-tools, in the dev extras) resolves against the public index only
# ($VGPU_LOCK_INDEX_URL, default https://pypi.org/simple), with no local pip configuration, so
# the hashes are those of the files the image build downloads. An existing lock file is a
# constraint: a pin changes only when pyproject.toml demands it, or with --upgrade. Needs .venv
# with the dev extras (.ci/run makes it) and the index to be reachable.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP_COMPILE=${PIP_COMPILE:-.venv/bin/pip-compile}
INDEX_URL=${VGPU_LOCK_INDEX_URL:-https://pypi.org/simple}
LOCK=requirements.lock
[ -x "$PIP_COMPILE" ] || { echo "lock_requirements: no $PIP_COMPILE (pip install -e '.[dev]')" >&2; exit 1; }

mode=write
extra=()
case "${1:-}" in
    "") ;;
    --check) mode=check ;;
    --upgrade) extra+=(--upgrade) ;;
    *) echo "usage: $0 [--check|--upgrade]" >&2; exit 2 ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -f "$LOCK" ] && cp "$LOCK" "$work/$LOCK"

# No pip configuration of this machine (local wheel directories, extra indexes, constraints):
# the lock must describe what the public index serves.
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT \
    PIP_CONFIG_FILE=/dev/null CUSTOM_COMPILE_COMMAND="tools/lock_requirements.sh" \
    "$PIP_COMPILE" --quiet --generate-hashes --no-strip-extras --allow-unsafe \
    --no-emit-index-url --no-emit-find-links --index-url "$INDEX_URL" \
    "${extra[@]}" --output-file "$work/$LOCK" pyproject.toml >"$work/log" 2>&1 || {
    cat "$work/log" >&2
    echo "lock_requirements: pip-compile failed" >&2
    exit 1
}

if [ "$mode" = check ]; then
    if ! diff -u "$LOCK" "$work/$LOCK" >"$work/diff"; then
        cat "$work/diff" >&2
        echo "lock_requirements: $LOCK is stale: run tools/lock_requirements.sh" >&2
        exit 1
    fi
    echo "lock_requirements: $LOCK is current"
else
    cp "$work/$LOCK" "$LOCK"
    echo "lock_requirements: wrote $LOCK"
fi
