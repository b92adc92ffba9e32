#!/usr/bin/env bash
# On the lent GPU machine: stage the GPU kit's parts (launch/gpu_kit.sh made them) that this call carried, and
# once every part is there, verify them against the manifest, join them, and install the wheels for Python 3.12.
#
#   bash launch/gpu_kit_install.sh [KIT]      # KIT: the carried folder (default .gpu_kit in this repository)
#
# Intended calls (the device tool's `run`; each carries one part, back to back so the machine stays warm):
#   call 1 .. N:  carry [".gpu_kit/part-K"], command "bash launch/gpu_kit_install.sh"
#                 each copies its pieces into STAGE (/tmp/gpu_kit, outside the repository, kept while the
#                 machine stays warm), checked against the manifest. A call that leaves parts missing names
#                 them and exits 3; the one that completes the set joins the pieces and pip-installs every
#                 wheel into SITE (/tmp/site) with --no-index --no-deps: nothing is fetched there.
#   call N+1:     "PYTHONPATH=/tmp/site bash launch/gpu_acceptance.sh all /tmp/acc; tar -czf $OUT/acc.tgz -C /tmp acc"
# A fresh machine (one given back in between) has neither STAGE nor SITE: carry every part again.
# N is launch/gpu_kit.sh's part count (it prints the sequence): what the working tree leaves of a call's 64 MiB.
# GPU_KIT_STAGE and GPU_KIT_SITE move STAGE and SITE. Exit: 0 installed (or already), 3 parts missing, 1 error.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
kit=${1:-.gpu_kit}
stage=${GPU_KIT_STAGE:-/tmp/gpu_kit}
site=${GPU_KIT_SITE:-/tmp/site}
mkdir -p "$stage"

shopt -s nullglob
carried=("$kit"/part-*/)
for part in "${carried[@]}"; do
  cp -f "$part"* "$stage"/
done
echo "gpu_kit_install: staged ${#carried[@]} part(s) carried in this call: ${carried[*]:-none}"
if [[ ! -f $stage/MANIFEST.tsv ]]; then
  echo "gpu_kit_install: no manifest in $stage: carry a part of the kit (.gpu_kit/part-K)" >&2; exit 1
fi

installed=$site/.gpu_kit_manifest
if [[ -f $installed ]] && cmp -s "$installed" "$stage/MANIFEST.tsv"; then
  echo "gpu_kit_install: this kit is already installed in $site"; exit 0
fi

rc=0
rm -rf "$stage/wheels"  # joined afresh: a wheel of an older kit left there would be installed beside its successor
python3 launch/gpu_kit_parts.py assemble "$stage" "$stage/wheels" || rc=$?
if ((rc != 0)); then exit "$rc"; fi

started=$(date +%s)
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$site" "$stage"/wheels/*.whl
cp "$stage/MANIFEST.tsv" "$installed"
echo "gpu_kit_install: installed in $site in $(($(date +%s) - started)) s; use it with PYTHONPATH=$site"
python3 -m pip list --disable-pip-version-check --path "$site" 2>/dev/null | tail -n +3 | tr -s ' ' | paste -sd ',' -
