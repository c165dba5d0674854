#!/usr/bin/env bash
# The GPU check, ready to run on a machine with one CUDA GPU (the device tool's H200, a
# GB300 node): the encoder batch sweep and the loadgen A/B (encoder batching off vs on)
# for tiny.en and base, then a short table last. Sized to finish in under 8 minutes.
#
#   scripts/gpu_check.sh [OUT_DIR]          # default: $OUT or bench-out/gpu
#
# Installs nothing: run it where the project's virtualenv (or carried wheels) already
# provide torch with CUDA and the project's dependencies. espeak-ng and sox make the
# manifest; without them pass ASR_MANIFEST=path/to/manifest.jsonl made elsewhere.
# GPU_CHECK_DEVICE=cpu runs the same steps on a CPU (a smoke run of the script itself).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench-out/gpu}}
device=${GPU_CHECK_DEVICE:-cuda}
mkdir -p "$out"
py=${PYTHON:-python}
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && py=.venv/bin/python
export PYTHONUNBUFFERED=1

if [[ "$device" == cuda ]]; then
    "$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    sizes=1,4,16,64; levels=16,64; per_level=128; slots=64
else
    sizes=1,4; levels=2; per_level=4; slots=8
fi

manifest=${ASR_MANIFEST:-$out/manifest/manifest.jsonl}
if [[ ! -f "$manifest" ]]; then
    "$py" -m clients.loadgen make-manifest --out "$(dirname "$manifest")" --telephone --count 64
fi

for model in tiny.en base; do
    timeout 100 "$py" scripts/bench_engine.py --model "$model" --device "$device" --batch-sizes "$sizes" \
        --contexts full --repeats 3 > "$out/engine-$model.log" 2>&1 || echo "engine sweep $model: failed (see $out/engine-$model.log)"
    timeout 140 "$py" scripts/bench_loadgen_ab.py --manifest "$manifest" --concurrency "$levels" \
        --utterances-per-level "$per_level" --out "$out/ab-$model" \
        -- --model "$model" --device "$device" --kv-slots "$slots" --max-batch 64 --batch-window-ms 10 \
        > "$out/ab-$model.log" 2>&1 || echo "loadgen A/B $model: failed (see $out/ab-$model.log)"
done

echo
echo "## GPU check: $(date -u +%F) on $("$py" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")"
for model in tiny.en base; do
    echo
    echo "### $model: encoder, loop of B single calls vs one batch-B call"
    grep -E '^\| (full|trim) ' "$out/engine-$model.log" || true
    echo
    echo "### $model: server throughput, encoder batching off vs on"
    cat "$out/ab-$model/compare.md" 2>/dev/null || echo "(no A/B table)"
done
