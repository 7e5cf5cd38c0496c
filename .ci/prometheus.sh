#!/usr/bin/env bash
# Install Prometheus (with promtool) for tests/test_observability_prometheus.py, from Debian's package, when it is
# not on PATH already. Without apt, root or network it says so; under CI=true that fails the run (the
# end-to-end test must not skip there), elsewhere it exits 0 and the test skips with its reason.
#   .ci/prometheus.sh            # called by .ci/run before the tests
set -uo pipefail

give_up() {  # a reason
    echo "prometheus.sh: $1"
    if [ "${CI:-}" = "true" ]; then
        echo "prometheus.sh: CI=true: the Prometheus end-to-end test would skip; failing instead" >&2
        exit 1
    fi
    exit 0
}

if command -v prometheus >/dev/null 2>&1; then
    echo "prometheus.sh: $(command -v prometheus) is already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    give_up "apt-get not found: not installing prometheus (its end-to-end test will be skipped)"
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        give_up "not root and no password-less sudo: not installing prometheus (its end-to-end test will be skipped)"
    fi
fi

# Keep the package's service from starting: the tests start their own prometheus on free ports.
POLICY=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$POLICY" ]; then
    if printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null 2>&1 && $SUDO chmod +x "$POLICY"; then
        made_policy=1
    fi
fi
cleanup() { if [ "$made_policy" = 1 ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get update -qq; then
    give_up "apt-get update failed: not installing prometheus (its end-to-end test will be skipped)"
fi
if ! $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
    give_up "apt-get install prometheus failed (its end-to-end test will be skipped)"
fi
if command -v prometheus >/dev/null 2>&1; then
    echo "prometheus.sh: installed $(prometheus --version 2>&1 | head -n 1)"
else
    give_up "the package installed but prometheus is not on PATH (its end-to-end test will be skipped)"
fi
exit 0
