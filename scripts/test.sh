#!/usr/bin/env bash
# The whole test suite (the README's test command): installs NIXL's
# libraries if they are missing (the `nixl` transport's tests run for real,
# on the CPU over UCX), then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-nixl.sh
exec cargo test --workspace "$@"
