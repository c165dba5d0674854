# shellcheck shell=bash
# What each part of the GPU check carries (the device tool's `carry` list), in one place for
# scripts/gpu_pack.sh (sizes), scripts/gpu_rehearse.sh (the rehearsal's copy) and the docs.
carry_for() {
    case "$1" in
        1) echo ".gpu/COMMIT .gpu/cache .gpu/w1" ;;  # random-weight benches: host packages only
        2) echo ".gpu/COMMIT .gpu/wheels .gpu/audio .gpu/w2" ;;  # real weights, server path
        *) echo "carry_for: part 1 or 2" >&2; return 2 ;;
    esac
}
