#!/usr/bin/env bash
# Install what the tests need into .venv, then run the test suite.
# Exit status is pytest's, except that "no tests collected" (5) is a failure too.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test || exit 1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
