#!/usr/bin/env bash
# Asterisk 22 (chan_websocket, AudioSocket) for the telephony tests: Debian's unstable suite has it, and its
# libc is newer than Debian 12's, so it runs in a chroot built from Debian's own packages. Idempotent: a
# finished chroot (its .ready stamp) is reused. Needs root (debootstrap, chroot, mount).
#   scripts/asterisk_chroot.sh [DIR]      default: $ASTERISK_CHROOT or /var/cache/callcenter-asr/asterisk-sid
set -euo pipefail
DIR="${1:-${ASTERISK_CHROOT:-/var/cache/callcenter-asr/asterisk-sid}}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
[[ -f "$DIR/.ready" ]] && { echo "$DIR"; exit 0; }
command -v debootstrap >/dev/null || { apt-get update -q && apt-get install -y -q --no-install-recommends debootstrap; }
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
debootstrap --variant=minbase sid "$DIR" "$MIRROR" >/dev/null
# sid's Release file carries a Valid-Until date an offline mirror copy may be past
echo 'Acquire::Check-Valid-Until "false";' > "$DIR/etc/apt/apt.conf.d/99no-valid-until"
printf '#!/bin/sh\nexit 101\n' > "$DIR/usr/sbin/policy-rc.d"  # no service starts inside the chroot
chmod +x "$DIR/usr/sbin/policy-rc.d"
mount -t proc proc "$DIR/proc"
trap 'umount "$DIR/proc" 2>/dev/null || true' EXIT
chroot "$DIR" apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive chroot "$DIR" apt-get install -y -q --no-install-recommends asterisk asterisk-modules >/dev/null
chroot "$DIR" asterisk -V
touch "$DIR/.ready"
echo "$DIR"
