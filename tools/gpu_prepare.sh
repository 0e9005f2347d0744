#!/usr/bin/env bash
# Prepare what the GPU check needs on a GPU host that has Python 3.12 and torch but no Megatron-Core
# and no network: the Megatron-Core wheel of each CI release line (tools/releases.txt), in .gpu/wheels
# (ignored by git; it travels with the working tree when named as a carried path). Everything else the
# tests import there (einops, psutil, pytest, pytest-timeout, numpy, packaging, triton) is already on
# such a host (the device image's package list); this package travels as the working tree itself.
#
# What cannot travel, and so is not part of the check: Transformer Engine and Apex (CUDA builds, far
# over the size limit; the FusedAdam path runs the package's own CPU stand-in of Apex's interface on
# CUDA tensors), nvidia-resiliency-ext (--async-save's persistent writer), Megatron-FSDP's kernels
# and fla (Gated-DeltaNet). docs/validation.md lists the scenarios this leaves out and why.
#
# Usage: bash tools/gpu_prepare.sh [RELEASE ...]   (default: every line of tools/releases.txt on Python 3.12,
#                                                   and 0.16.1, which installs there too)
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT_MIB=48  # of the 64 MiB a carried working tree may hold: the rest is the repository itself
releases=("$@")
if [ ${#releases[@]} -eq 0 ]; then
  mapfile -t releases < <(awk '!/^#/ && NF && $3 !~ /^fixes=/ {print $1}' tools/releases.txt)
fi
mkdir -p .gpu/wheels
for rel in "${releases[@]}"; do
  if ls .gpu/wheels/megatron_core-"$rel"-*.whl >/dev/null 2>&1; then continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .gpu/wheels "megatron-core==$rel"
done
size=$(du -sm .gpu | cut -f1)
echo "gpu_prepare: $(ls .gpu/wheels | wc -l) wheel(s) in .gpu/wheels, ${size} MiB (limit ${LIMIT_MIB} MiB): ${releases[*]}"
if [ "$size" -gt "$LIMIT_MIB" ]; then
  echo "gpu_prepare: .gpu is over ${LIMIT_MIB} MiB: name fewer releases" >&2
  exit 1
fi
