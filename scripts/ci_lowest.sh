#!/usr/bin/env bash
# `make test-lowest`: the lowest versions pyproject.toml allows (jax 0.11.2, the GPU image's)
# in a second venv, .venv-lowest, in two passes:
#   1. image-like: every package the GPU image does not list (scripts/gpu_image_packages.txt)
#      is removed (meshtrain, grain, tyro and theirs), and the GPU kit's dry run installs the
#      bundle (.whl, `make gpu-bundle`) the way scripts/gpu_check.sh does on a GPU machine;
#   2. lowest: the removed pins come back, meshtrain is installed, and a smoke subset runs
#      (import, 2-step train on 2×2×2, a 1F1B pipeline, kernels in interpret mode, a checkpoint
#      round trip, every kernel lowered for an H100, cuDNN's attention per shard and exported
#      for cuda through the private packed layout the GPU image's jax has).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3.12}"
V=.venv-lowest
mkdir -p build
.venv/bin/python scripts/lowest_versions.py > build/lowest.txt
echo "lowest versions: $(tr '\n' ' ' < build/lowest.txt)"
# their pytest runs keep build/suite_times.json the main suite's (.ci/run prints it last)
export MESHTRAIN_SUITE_TIMES=build/suite_times-lowest.json
pytest_ok() { rc=0; "$@" || rc=$?; [ $rc -eq 5 ] && { echo "no tests collected"; rc=0; }; return $rc; }

t0=$SECONDS
test -x $V/bin/python || "$PY" -m venv $V
$V/bin/python -m pip install -q -r build/lowest.txt pytest setuptools
echo "[lowest] venv with the lowest pins: $((SECONDS - t0)) s"

t1=$SECONDS
$V/bin/python - <<'PYEOF'
import importlib.metadata as md
import re
import subprocess
import sys

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

lines = open("scripts/gpu_image_packages.txt").read().splitlines()
image = {norm(x) for x in lines if x.strip() and not x.startswith("#")}
installed = {norm(d.metadata["Name"]) for d in md.distributions()}
drop = sorted(installed - image - {"pip", "setuptools", "wheel"})
print("[lowest] image-like venv: removing", " ".join(drop))
if drop:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *drop], check=True)
PYEOF
MESHTRAIN_KIT_PYTHON=$V/bin/python MESHTRAIN_KIT_WHEELS=.whl \
  pytest_ok .venv/bin/python -m pytest -q -p no:cacheprovider -m kit tests/test_gpu_kit.py
echo "[lowest] GPU kit dry run in the image-like venv: $((SECONDS - t1)) s"

t2=$SECONDS
$V/bin/python -m pip install -q -r build/lowest.txt pytest
$V/bin/python -m pip install -q --no-deps --no-build-isolation -e .
pytest_ok $V/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_lowest_smoke.py tests/test_kernels_lowering.py tests/test_kernels_cudnn.py
echo "[lowest] smoke subset on the lowest versions: $((SECONDS - t2)) s"
echo "[lowest] total $((SECONDS - t0)) s"
