#!/usr/bin/env bash
# Install fastckpt into .venv and run the elastic demo (4 hosts x 2 devices; one is killed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh demo
exec .venv/bin/fastckpt demo "$@"
