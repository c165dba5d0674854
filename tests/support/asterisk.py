"""A real Asterisk 22 for the telephony tests, run in the Debian-unstable chroot scripts/asterisk_chroot.sh
builds (Asterisk 22 needs a newer libc than this machine's). Each `Asterisk` has its own configuration,
run and log directories inside the chroot, loads only the modules the tests use, and is driven with its
own CLI (`asterisk -rx`), its modules as the package loads them (autoload: loading only a chosen few
made this build exit 2 at start). A call comes in over SIP: a phone (tests/support/sip_phone.py, PJSUA2)
calls Asterisk's PJSIP on `sip_port` and says a WAV file; the extension it dials runs the dialplan under
test (AudioSocket, or Dial over chan_websocket)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHROOT = Path(os.environ.get("ASTERISK_CHROOT", "/var/cache/callcenter-asr/asterisk-sid"))


def ensure_chroot() -> Path:
    """The chroot, built on first use (a few minutes: ~640 MB from Debian's mirror) and kept. One machine
    has one: pytest-xdist workers (and other checkouts) take a lock, so that one builds it and mounts its
    /proc while the others wait."""
    CHROOT.parent.mkdir(parents=True, exist_ok=True)
    with open(CHROOT.parent / f".{CHROOT.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (CHROOT / ".ready").exists():
            subprocess.run(
                [str(REPO / "scripts" / "asterisk_chroot.sh"), str(CHROOT)], check=True, timeout=1800
            )
        proc = CHROOT / "proc"
        if not (proc / "self").exists():
            subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
    return CHROOT


class Asterisk:
    def __init__(
        self, dialplan: str, websocket_clients: str = "", sip_port: int = 0, ari_port: int = 0
    ) -> None:
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
        self.sip_port = sip_port
        self._write("pjsip.conf", self._pjsip_conf(sip_port) if sip_port else "")
        # ARI (the REST interface a Stasis application drives calls with) on loopback, one user
        self.ari_port = ari_port
        self.ari_auth = ("asr-test", uuid.uuid4().hex)
        if ari_port:
            self._write(
                "http.conf", f"[general]\nenabled = yes\nbindaddr = 127.0.0.1\nbindport = {ari_port}\n"
            )
            self._write(
                "ari.conf",
                f"[general]\nenabled = yes\n\n[{self.ari_auth[0]}]\ntype = user\nread_only = no\n"
                f"password = {self.ari_auth[1]}\n",
            )
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

    @staticmethod
    def _pjsip_conf(port: int) -> str:
        """SIP on loopback only; calls from any caller there (the anonymous endpoint) run the dialplan's
        `from-phone` context, in mu-law as a G.711 trunk would send."""
        return (
            f"[udp]\ntype = transport\nprotocol = udp\nbind = 127.0.0.1:{port}\n\n"
            "[anonymous]\ntype = endpoint\ncontext = from-phone\ndisallow = all\nallow = ulaw\n"
            "direct_media = no\nrtp_symmetric = yes\n"
        )

    def start(self) -> Asterisk:
        # not -U root: Asterisk would drop CAP_DAC_OVERRIDE and could not open its own database
        self.proc = subprocess.Popen(
            ["chroot", str(self.chroot), "asterisk", "-f", "-vvv", "-C", f"{self.inside}/etc/asterisk.conf"],
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

    def set_global(self, name: str, value: str) -> None:
        self.cli(f"dialplan set global {name} {value}")

    def sip_uri(self, extension: str) -> str:
        return f"sip:{extension}@127.0.0.1:{self.sip_port}"

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
