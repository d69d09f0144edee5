#!/usr/bin/env bash
# The packages bench/gpu_session.sh needs beyond a CUDA JAX image (JAX, flax, optax, orbax,
# chex, numpy, safetensors and the like already installed), as Python 3.12 wheels in .whl/, for
# a GPU machine that cannot reach PyPI: tokamax and what it imports, ml-collections, grain.
# There, before the session:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site bash bench/gpu_session.sh
set -euo pipefail
DEST=${1:-.whl}
mkdir -p "$DEST"
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "$@" -d "$DEST"
}
many="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64"
# shellcheck disable=SC2086
get $many tokamax==0.0.17 einshape pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
  typing-inspection qwix immutabledict tensorboardx fire termcolor gviz_api cheroot portpicker \
  ml-collections grain==0.2.18 array-record
get --platform manylinux_2_27_x86_64 xprof==2.24.2  # tokamax imports its profiler tools
du -sh "$DEST"
