#!/usr/bin/env bash
# Sets up a fresh machine for serving and testing: system packages, a virtualenv with the
# pinned CPU torch, the project and its dev tools, and the npm tools the tests use.
# Idempotent: a second run only checks. Set ASR_SKIP_APT=1 to skip the system packages.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(espeak-ng sox libsox-fmt-all prometheus nodejs npm curl pocketsphinx-testdata sip-tester)
if [[ "${ASR_SKIP_APT:-0}" != 1 ]] && command -v apt-get >/dev/null; then
    missing=()
    for pkg in "${apt_packages[@]}"; do
        # nodejs/npm may come from elsewhere (NodeSource); a working binary is enough
        case "$pkg" in nodejs) command -v node >/dev/null && continue ;; npm) command -v npm >/dev/null && continue ;; esac
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        sudo=""; [[ "$(id -u)" == 0 ]] || sudo=sudo
        $sudo apt-get update -q
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
fi

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
# torch first and pinned: an unpinned requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==${ASR_TORCH_VERSION:-2.13.0}"
.venv/bin/pip install -q -e ".[dev]"
# The end-of-turn model's weights (pipecat-ai's smart-turn v3.2 .onnx, BSD-2) into the server's cache
.venv/bin/python scripts/fetch_turn_model.py >/dev/null

# npm tools for tests: buf (a gRPC client we did not write) and the CRD schema checkers.
for dir in tests/tools deploy/tools; do
    if [[ -f "$dir/package-lock.json" && ! -d "$dir/node_modules" ]]; then
        (cd "$dir" && npm ci --silent --no-audit --no-fund)
    fi
done
# Asterisk 22 for the telephony tests, in a Debian-unstable chroot (root only; a minute or two, then kept)
if [[ "${ASR_SKIP_ASTERISK:-0}" != 1 && "$(id -u)" == 0 ]]; then
    # not fatal here: the telephony tests build it again on first use and say why it cannot be built
    scripts/asterisk_chroot.sh >/dev/null || echo "warning: the Asterisk chroot could not be built (scripts/asterisk_chroot.sh)" >&2
fi
echo "setup done: activate with '. .venv/bin/activate'"
