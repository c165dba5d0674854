#!/usr/bin/env bash
# Rehearses the GPU check here, on CPU, as the GPU host will see it: no network (`unshare -n`,
# needs root or user namespaces), a fresh virtualenv holding only packages the host has
# preinstalled (torch installed first and pinned, CPU build here), and for each part a fresh
# copy of just what the device tool sends (tracked and untracked-not-ignored files plus that
# part's carry list, scripts/gpu_carry.sh), with Python 3.11 wheels standing in for cp312 ones.
# Part 2 runs in a second copy that lacks part 1's files, so the weight hand-over is proven too.
#
#   scripts/gpu_rehearse.sh [--quick]     # --quick: the smallest sizes (CI: tests/test_gpu_rehearsal.py)
#
# Prints both parts' output; exits non-zero if either part failed or left more than 8 files in
# its output folder. GPU_REHEARSE_DIR keeps the copies and outputs there (default: a temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
size=small
[[ "${1:-}" == --quick ]] && size=quick
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3

scripts/gpu_pack.sh

dir=${GPU_REHEARSE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-rehearse.XXXXXX")}
mkdir -p "$dir"
rm -rf "$dir/part1" "$dir/part2" "$dir/stash" "$dir/out1" "$dir/out2"

# The host's preinstalled packages (.library KINDS.md), at the project venv's versions so pip's
# cache serves them; torch first and pinned, as scripts/setup.sh does. Installing torch and the
# rest takes minutes on 2 busy cores, so the venv is kept, keyed by exactly what went into it;
# GPU_REHEARSE_FRESH=1 builds it again.
packages="transformers grpcio protobuf onnxruntime numpy scipy prometheus-client pytest matplotlib requests"
torch_pin="torch==${ASR_TORCH_VERSION:-2.13.0}"
pins=$(if [[ -x .venv/bin/pip ]]; then .venv/bin/pip freeze 2>/dev/null | grep '==' | grep -iv '^callcenter' || true; fi)
key=$(printf '%s\n' "$("$py" --version)" "$torch_pin" "$packages" "$pins" | sha256sum | cut -c1-16)
venv=${XDG_CACHE_HOME:-$HOME/.cache}/callcenter-asr/gpu-rehearse-venv-$key
if [[ "${GPU_REHEARSE_FRESH:-0}" == 1 || ! -f "$venv/complete" ]]; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    printf '%s\n' "$pins" >"$dir/pins.txt"
    "$py" -m venv "$venv"
    # --no-compile: byte-compiling torch alone takes minutes here
    "$venv/bin/pip" install -q --no-compile --disable-pip-version-check "$torch_pin"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q --no-compile --disable-pip-version-check -c "$dir/pins.txt" "$torch_pin" $packages
    touch "$venv/complete"  # only a finished install is reused
fi
echo "gpu_rehearse: venv $venv"

# No network: a new network namespace (as root; else inside a user namespace, mapped to root).
netns=(unshare -n)
[[ "$(id -u)" == 0 ]] || netns=(unshare -rn)
"${netns[@]}" true || { echo "gpu_rehearse: '${netns[*]}' is not permitted here" >&2; exit 1; }

# shellcheck source=scripts/gpu_carry.sh
. scripts/gpu_carry.sh
status=0
for part in 1 2; do
    copy=$dir/part$part
    mkdir -p "$copy"
    git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$copy"
    for path in $(carry_for "$part"); do
        mkdir -p "$copy/$(dirname "$path")"
        cp -a "$path" "$copy/$path"
    done
    if [[ -d "$copy/.gpu/wheels" ]]; then  # this machine's Python is 3.11: its wheels stand in
        rm -rf "$copy/.gpu/wheels"
        cp -a .gpu/wheels-py311 "$copy/.gpu/wheels"
    fi
    mkdir -p "$dir/out$part" "$dir/home"
    echo "== rehearsal part $part: offline, in $copy"
    rc=0
    # A new network namespace has only a loopback interface, and it starts down: bring it up
    # (the host's is up) so the server path can listen on 127.0.0.1.
    "${netns[@]}" bash -c 'ip link set lo up && exec "$@"' rehearse \
        env -i PATH="$venv/bin:/usr/bin:/bin" HOME="$dir/home" LANG=C.UTF-8 OUT="$dir/out$part" \
        GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE="$size" GPU_CHECK_STASH="$dir/stash" GPU_CHECK_TIME_SCALE=4 \
        bash "$copy/scripts/gpu_check.sh" "$part" || rc=$?
    files=$(find "$dir/out$part" -type f | wc -l)
    echo "== rehearsal part $part: exit $rc, $files files in its output folder: $(ls "$dir/out$part" | tr '\n' ' ')"
    ((rc == 0 && files <= 8)) || status=1
done
echo
echo "== rehearsal tables"
cat "$dir/out1/tables-part1.md" "$dir/out2/tables-part2.md" 2>/dev/null || true
[[ -n "${GPU_REHEARSE_DIR:-}" ]] || rm -rf "$dir"
cd "$repo"
echo "== rehearsal: $([[ $status == 0 ]] && echo passed || echo FAILED)"
exit $status
