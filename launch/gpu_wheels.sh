#!/usr/bin/env bash
# The Python packages launch/gpu_measure.sh needs that a bare GPU image lacks, as wheels in .whl/ (git-ignored through
# .git/info/exclude; a remote run carries it with the tree). The image of 2026-11 (Python 3.12, jax 0.11.2,
# flax, optax, orbax, etils, protobuf, absl-py, cloudpickle, tqdm, jaxtyping ...) has none of grain, tensorboardX,
# tensorflow-datasets (only looked up by the train extra's check, never imported for data.source=default) or tokamax
# (the mosaic_gpu backend) and their needs below: 48 MB, which with the tracked tree (~19 MB) stays under a remote run's
# 64 MiB. gpu_measure.sh installs them with pip --no-deps into /tmp/site.
# It also copies nanochat's tree (nanochat-9d4c9b7, for the side by side; its code is not part of this repository)
# from $SINKJAX_NANOCHAT_PEERS or ../shared/peers into .peers/ (git-ignored): a remote run carries both
# `carry: [".whl", ".peers"]` (~0.1 MB more).
#   bash launch/gpu_wheels.sh [DIR]      (default .whl; needs pip and PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
exclude=$(git rev-parse --git-path info/exclude)     # .git/info/exclude, also in a worktree
grep -qs '^/.whl/$' "$exclude" || { mkdir -p "$(dirname "$exclude")"; echo /.whl/ >> "$exclude"; }
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dir" \
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 importlib_resources==7.1.0 \
  tensorboardX==2.6.5 tensorflow-datasets==4.9.10 \
  tokamax==0.0.17 einshape==1.0 immutabledict==4.3.1 qwix==0.1.8 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0
du -sh "$dir"
peers=${SINKJAX_NANOCHAT_PEERS:-../shared/peers}
if [ -f "$peers/nanochat-9d4c9b7/nanochat/gpt.py" ]; then
  rm -rf .peers/nanochat-9d4c9b7
  mkdir -p .peers
  cp -r "$peers/nanochat-9d4c9b7" .peers/
  du -sh .peers
else
  echo "gpu_wheels: no nanochat tree at $peers/nanochat-9d4c9b7 (set SINKJAX_NANOCHAT_PEERS): the side by side needs it" >&2
  exit 1
fi
