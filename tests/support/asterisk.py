"""A real Asterisk 22 for the telephony tests, run in the Debian-unstable chroot scripts/asterisk_chroot.sh
builds (Asterisk 22 needs a newer libc than this machine's). Each `Asterisk` has its own configuration,
run and log directories inside the chroot, loads only the modules the tests use, and is driven with its
own CLI (`asterisk -rx`), its modules as the package loads them (autoload: loading only a chosen few
made this build exit 2 at start): a call is a Local channel whose one side plays a WAV file (what the caller
says) and whose other side runs the dialplan under test (AudioSocket, or Dial over chan_websocket)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[2]
CHROOT = Path(os.environ.get("ASTERISK_CHROOT", "/var/cache/callcenter-asr/asterisk-sid"))


def ensure_chroot() -> Path:
    """The chroot, built on first use (a few minutes: ~640 MB from Debian's mirror) and kept."""
    if not (CHROOT / ".ready").exists():
        subprocess.run([str(REPO / "scripts" / "asterisk_chroot.sh"), str(CHROOT)], check=True, timeout=1800)
    proc = CHROOT / "proc"
    if not (proc / "self").exists():
        subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
    return CHROOT


class Asterisk:
    def __init__(self, dialplan: str, websocket_clients: str = "") -> None:
        self.chroot = ensure_chroot()
        self.name = f"asr-test-{uuid.uuid4().hex[:8]}"
        self.inside = Path("/var/tmp") / self.name  # the run's directory as Asterisk sees it
        self.root = self.chroot / self.inside.relative_to("/")
        for sub in ("run", "log", "db", "spool", "audio"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # the package's own configuration (the core needs some of it, indications.conf first), then ours
        shutil.copytree(self.chroot / "etc" / "asterisk", self.root / "etc")
        self._write("asterisk.conf", self._asterisk_conf())
        self._write("logger.conf", "[general]\n[logfiles]\nmessages.log = notice,warning,error\n")
        self._write("extensions.conf", dialplan)
        self._write("websocket_client.conf", websocket_clients)
        self._write("chan_websocket.conf", "[global]\ncontrol_message_format = plain-text\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def _write(self, name: str, text: str) -> None:
        (self.root / "etc" / name).write_text(text)

    def _asterisk_conf(self) -> str:
        i = self.inside
        return (
            "[directories]\n"
            f"astetcdir => {i}/etc\nastrundir => {i}/run\nastlogdir => {i}/log\nastdbdir => {i}/db\n"
            f"astspooldir => {i}/spool\nastvarlibdir => /var/lib/asterisk\nastdatadir => /usr/share/asterisk\n"
            "astmoddir => /usr/lib/x86_64-linux-gnu/asterisk/modules\nastcachedir => /var/cache/asterisk\n"
            "astkeydir => /var/lib/asterisk\nastagidir => /usr/share/asterisk/agi-bin\nastsbindir => /usr/sbin\n"
            "[options]\nnofork = yes\n"
        )

    def start(self) -> Asterisk:
        # not -U root: Asterisk would drop CAP_DAC_OVERRIDE and could not open its own database
        self.proc = subprocess.Popen(
            ["chroot", str(self.chroot), "asterisk", "-f", "-C", f"{self.inside}/etc/asterisk.conf"],
            stdin=subprocess.DEVNULL,
            stdout=(self.root / "log" / "console.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"asterisk exited {self.proc.returncode}: {self.log()[-2000:]}")
            if (self.root / "run" / "asterisk.ctl").exists():
                try:
                    if "fully booted" in self.cli("core waitfullybooted", timeout=10).lower():
                        return self
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                    pass
            time.sleep(0.3)
        raise RuntimeError(f"asterisk did not boot: {self.log()[-2000:]}")

    def cli(self, command: str, timeout: float = 30) -> str:
        return subprocess.run(
            [
                "chroot",
                str(self.chroot),
                "asterisk",
                "-C",
                f"{self.inside}/etc/asterisk.conf",
                "-rx",
                command,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout

    def audio_file(self, name: str, audio: np.ndarray, rate: int) -> str:
        """`audio` as an 8 kHz 16-bit WAV Asterisk can play; the path to give Playback (no extension)."""
        import soxr

        samples = soxr.resample(audio, rate, 8000) if rate != 8000 else audio
        sf.write(self.root / "audio" / f"{name}.wav", samples, 8000, subtype="PCM_16")
        return f"{self.inside}/audio/{name}"

    def set_global(self, name: str, value: str) -> None:
        self.cli(f"dialplan set global {name} {value}")

    def originate(self, play_context: str, run_context: str) -> None:
        """A call: Local/s@play_context plays its file; its other side runs s@run_context."""
        self.cli(f"channel originate Local/s@{play_context} extension s@{run_context}")

    def log(self) -> str:
        path = self.root / "log" / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.cli("core stop now", timeout=10)
                self.proc.wait(10)
            except (subprocess.SubprocessError, OSError):
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)
