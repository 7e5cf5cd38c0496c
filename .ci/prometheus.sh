#!/usr/bin/env bash
# Install Prometheus (with promtool) for tests/test_observability.py, from Debian's package, when it is
# not on PATH already. Never fails CI: without apt, root or network it says so and exits 0, and the
# end-to-end test skips with its reason.
#   .ci/prometheus.sh            # called by .ci/run before the tests
set -uo pipefail

if command -v prometheus >/dev/null 2>&1; then
    echo "prometheus.sh: $(command -v prometheus) is already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus.sh: apt-get not found: not installing prometheus (its end-to-end test will be skipped)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "prometheus.sh: not root and no password-less sudo: not installing prometheus (its end-to-end test will be skipped)"
        exit 0
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
    echo "prometheus.sh: apt-get update failed: not installing prometheus (its end-to-end test will be skipped)"
    exit 0
fi
if ! $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
    echo "prometheus.sh: apt-get install prometheus failed (its end-to-end test will be skipped)"
    exit 0
fi
if command -v prometheus >/dev/null 2>&1; then
    echo "prometheus.sh: installed $(prometheus --version 2>&1 | head -n 1)"
else
    echo "prometheus.sh: the package installed but prometheus is not on PATH (its end-to-end test will be skipped)"
fi
exit 0
