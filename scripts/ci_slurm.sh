#!/usr/bin/env bash
# CI's SLURM stage: a one-node SLURM from Debian's packages (installed when absent, which
# needs root), the Scaling out guide's recipes on it (scripts/slurm_recipes.py), and the
# daemons stopped again whatever happened.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/slurm_cluster.sh
dir=$(mktemp -d -t meshtrain-slurm.XXXXXX)
trap 'slurm_down "$dir"; rm -rf "$dir"' EXIT
start=$SECONDS
slurm_up "$dir"
echo "slurm: set up in $((SECONDS - start)) s" >&2
.venv/bin/python scripts/slurm_recipes.py --work "$dir/runs" "$@"
echo "slurm: the stage took $((SECONDS - start)) s" >&2
