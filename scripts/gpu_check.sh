#!/usr/bin/env bash
# The GPU check, for a bare offline host with one CUDA GPU (the device tool's H200): run
# scripts/gpu_pack.sh here first, then two back-to-back device calls (docs/benchmarks.md,
# "GPU check", gives the exact calls and carry lists):
#
#   scripts/gpu_check.sh 1   random-weight Whisper at large-v3, base and tiny dimensions: the
#                            encoder pass batched vs looped (B = 1..64, full and trimmed context)
#                            and the engine end to end with encoder batching off vs on at 16
#                            and 64 callers. Leaves tiny.en's first weight piece in $STASH.
#   scripts/gpu_check.sh 2   joins tiny.en's weights (the host must still be warm: 30 s), then
#                            the decode step with CUDA graphs off vs on, real weights on real
#                            clips (tokens fp16/bf16 vs CPU fp32, WER) and the loadgen A/B through
#                            asr-server with 200 ms chunks.
#
# Uses only `python3` and the host's packages plus the carried wheels (installed offline into a
# private folder). Prints versions, device, driver and commit first and each table as soon as it
# is done; every step has its own timeout; at most 3 files land in $OUT (tables, full log, a
# tarball of each step's output); exits non-zero if any step failed.
#
# Environment: GPU_CHECK_DEVICE (cuda; cpu for the rehearsal), GPU_CHECK_SIZE (full; small or
# quick for the CPU rehearsal), GPU_CHECK_STASH (/tmp/asr-gpu-stash: where part 1 leaves weights),
# GPU_CHECK_WHEELS (.gpu/wheels), GPU_CHECK_TIME_SCALE (1: step limits add up to under 9 minutes
# a part, inside the device tool's 10; the CPU rehearsal on a shared machine needs more).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
[[ "$part" == 1 || "$part" == 2 ]] || { echo "usage: scripts/gpu_check.sh 1|2" >&2; exit 2; }
device=${GPU_CHECK_DEVICE:-cuda}
size=${GPU_CHECK_SIZE:-full}
stash=${GPU_CHECK_STASH:-/tmp/asr-gpu-stash}
out=${OUT:-bench-out/gpu}
time_scale=${GPU_CHECK_TIME_SCALE:-1}  # the CPU rehearsal's steps are slower: it scales every limit
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
mkdir -p "$out" "$work/steps"
tables=$out/tables-part$part.md
log=$out/log-part$part.txt
: >"$tables"
exec > >(tee -a "$log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XDG_CACHE_HOME=$work/xdg
failed=()
t_start=$SECONDS

finish() {
    echo
    echo "== part $part: $((SECONDS - t_start)) s; failed steps: ${failed[*]:-none}"
    tar -czf "$out/steps-part$part.tar.gz" -C "$work" steps 2>/dev/null || true
    rm -rf "$work"
    local rc=0
    ((${#failed[@]} == 0)) || rc=1
    exec >/dev/null 2>&1  # tee sees the end of its input and finishes the log before we return
    sleep 1
    exit $rc
}

# step NAME SECONDS CMD...: run under its own timeout, output to the log and its own file.
step() {
    local name=$1 limit=$(($2 * time_scale))
    shift 2
    echo
    echo "== step $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$work/steps/$name.log"
    local rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        failed+=("$name")
        ((rc == 124 || rc == 137)) && echo "== step $name: TIMED OUT after $limit s" || echo "== step $name: FAILED (exit $rc)"
        printf '### %s: FAILED (exit %s)\n\n' "$name" "$rc" >>"$tables"
    else
        echo "== step $name: ok in $((SECONDS - t0)) s"
    fi
    return 0
}

# --- preflight: python3, carried wheels, import path, versions ----------------------------------
echo "== GPU check part $part: $(date -u +%FT%TZ), device=$device size=$size"
echo "commit: $(cat .gpu/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
site=$work/site
wheels=${GPU_CHECK_WHEELS:-.gpu/wheels}  # the rehearsal points this at .gpu/wheels-py311
if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/*.whl || { failed+=(wheels); echo "== carried wheels did not install"; }
fi
export PYTHONPATH=$site:$PWD:$PWD/proto
modules=(torch transformers numpy prometheus_client engine harness.stats harness.usage)
((part == 2)) && modules+=(onnxruntime google.protobuf grpc grpc_health.v1 grpc_reflection.v1alpha
    soundfile soxr jiwer rapidfuzz silero_vad zmq aiohttp stdnum google.cloud.speech_v1 deepgram.listen.v1.types openai.types.realtime text_to_num asr.v1.asr_pb2 service.runtime.server service.runtime.supervisor
    clients.loadgen clients.scoring harness.server riva.client.proto.riva_asr_pb2)
step preflight 60 python3 - "${modules[@]}" <<'EOF'
import importlib, importlib.util, platform, subprocess, sys
bad = []
print(f"python {sys.version.split()[0]} at {sys.executable}, {platform.platform()}")
for name in sys.argv[1:]:
    try:
        if name == "silero_vad":  # the service reads its ONNX file; importing it needs torchaudio
            spec = importlib.util.find_spec(name)
            assert spec is not None, "not installed"
            mod, version = None, "(found)"
        else:
            mod = importlib.import_module(name)
            version = getattr(mod, "__version__", "")
        where = getattr(mod, "__file__", "") or ""
        print(f"  {name:28s} {version:14s} {where}")
    except Exception as exc:
        bad.append(name)
        print(f"  {name:28s} IMPORT FAILED: {exc!r}")
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
    try:
        q = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
        print("nvidia-smi:", subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip())
    except Exception as exc:
        print(f"nvidia-smi: {exc!r}")
print(f"CPU threads: {torch.get_num_threads()}")
sys.exit(1 if bad else 0)
EOF
if [[ " ${failed[*]:-} " == *" preflight "* ]]; then
    echo "== preflight failed: nothing else can run"
    finish
fi
if [[ "$device" == cuda ]]; then
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { failed+=(no-cuda); echo "== no CUDA device: stopping"; finish; }
fi

# --- sizes ------------------------------------------------------------------------------------
bench=(python3 scripts/bench_gpu.py --md "$tables" --device "$device")
case "$size" in
    full) models=(random:large-v3 random:base random:tiny); sizes=1,2,4,8,16,32,64; callers=16,64
          utts=128; ramp=0.5; clips=0; levels=16,64; per_level=128; slots=64; enc_t=(120 45 45); eng_t=(150 50 50) ;;
    small) models=(random:tiny); sizes=1,2,4; callers=2,4; utts=8; ramp=0.2; clips=4; levels=2,4; per_level=8
           slots=8; enc_t=(240); eng_t=(240) ;;
    quick) models=(random:tiny); sizes=2; callers=2; utts=2; ramp=0.1; clips=1; levels=2; per_level=2
           slots=4; enc_t=(120); eng_t=(120) ;;
    *) echo "GPU_CHECK_SIZE: full, small or quick" >&2; exit 2 ;;
esac
dtype=float16
[[ "$device" == cpu ]] && dtype=float32

if ((part == 1)); then
    # Weights for part 2 go to the stash first: quick, and useful even if a bench step fails.
    step stash 20 bash -c "mkdir -p '$stash' && cp .gpu/w1/tiny.en/model.bin.part1 .gpu/w1/tiny.en/model.bin.sha256 '$stash/'"
    repeats=3; [[ "$size" != full ]] && repeats=1
    contexts=full,trim; [[ "$size" == quick ]] && contexts=trim,full
    for i in "${!models[@]}"; do
        m=${models[$i]}
        step "encoder-${m#random:}" "${enc_t[$i]}" "${bench[@]}" --dtype "$dtype" --cache-dir .gpu/cache \
            encoder --model "$m" --batch-sizes "$sizes" --contexts "$contexts" --repeats "$repeats"
    done
    for i in "${!models[@]}"; do
        m=${models[$i]}
        step "engine-${m#random:}" "${eng_t[$i]}" "${bench[@]}" --dtype "$dtype" --cache-dir .gpu/cache \
            engine --model "$m" --concurrency "$callers" --utterances "$utts" --ramp-s "$ramp"
    done
    finish
fi

# --- part 2 -----------------------------------------------------------------------------------
weights=$work/tiny.en
step join-weights 30 bash -c "
    set -e
    mkdir -p '$weights'
    [[ -f '$stash/model.bin.part1' ]] || { echo 'no $stash/model.bin.part1: run part 1 again, then part 2 within 30 s'; exit 1; }
    cp .gpu/w2/tiny.en/config.json .gpu/w2/tiny.en/tokenizer.json .gpu/w2/tiny.en/vocabulary.txt '$weights/'
    cat '$stash/model.bin.part1' .gpu/w2/tiny.en/model.bin.part2 > '$weights/model.bin'
    want=\$(cat .gpu/w2/tiny.en/model.bin.sha256)
    got=\$(sha256sum '$weights/model.bin' | cut -d' ' -f1)
    [[ \"\$want\" == \"\$got\" ]] || { echo \"model.bin sha256 \$got, expected \$want\"; exit 1; }
    echo \"tiny.en joined: \$(stat -c %s '$weights/model.bin') bytes, sha256 ok\""
manifest=.gpu/audio/manifest.jsonl
if ((clips > 0)); then  # the rehearsal: fewer clips
    mkdir -p "$work/audio"
    tail -n "$clips" "$manifest" >"$work/audio/manifest.jsonl"  # the short ones
    cp .gpu/audio/*.wav "$work/audio/"
    manifest=$work/audio/manifest.jsonl
fi
if [[ " ${failed[*]:-} " != *" join-weights "* ]]; then
    dtypes=float16,bfloat16; [[ "$device" == cpu ]] && dtypes=bfloat16
    step decode-step 45 "${bench[@]}" --dtype "$dtype" --cache-dir "$work/cache" step --weights "$weights" \
        --batch-sizes "$sizes"
    step sanity 120 "${bench[@]}" --cache-dir "$work/cache" sanity --weights "$weights" --manifest "$manifest" \
        --dtypes "$dtypes"
    step server 300 "${bench[@]}" --cache-dir "$work/cache" server --weights "$weights" --manifest "$manifest" \
        --out "$work/steps/server" --concurrency "$levels" --utterances "$per_level" --kv-slots "$slots" \
        --threads "$([[ "$device" == cpu ]] && echo 2 || echo 4)"
fi
finish
