"""The GPU check's CPU rehearsal (scripts/gpu_rehearse.sh --quick), started in the background as soon as
pytest has collected its test, at the lowest CPU priority.

Under pytest-xdist the controller starts it once (tests/conftest.py) and the worker that runs its test
waits for the files it leaves. It takes minutes (a fresh venv, two server boots) but leaves most of its time waiting on pip and on
servers starting; run at `nice 19` it takes only the CPU the rest of the suite leaves idle (most tests
stream audio in real time), so the suite does not wait for it end to end. Its test waits for the result.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODE_ID = "tests/test_gpu_rehearsal.py::test_gpu_check_rehearsal_passes_offline"
LOG, RC = "rehearsal.log", "rehearsal.rc"  # in its directory: any process of the run can wait on them


@dataclass
class Rehearsal:
    directory: Path  # GPU_REHEARSE_DIR: its copies and out1/out2, and LOG and RC
    process: subprocess.Popen[bytes] | None = None  # None in an xdist worker: the controller started it

    def result(self, timeout_s: float) -> tuple[int, str]:
        """Exit status and the whole output (stdout and stderr), once it is over."""
        deadline = time.monotonic() + timeout_s
        while not (self.directory / RC).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the GPU rehearsal ran past {timeout_s:.0f} s")
            time.sleep(1.0)
        out = (self.directory / LOG).read_text(errors="replace")
        return int((self.directory / RC).read_text()), out

    def discard(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the script and every child it started
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def shared_directory(testrunuid: str) -> Path:
    """Where a run under xdist keeps it: named by the run, so that every worker finds it."""
    return Path(tempfile.gettempdir()) / f"gpu-rehearse-{testrunuid}"


def start(directory: Path | None = None) -> Rehearsal:
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="gpu-rehearse-"))
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GPU_REHEARSE_DIR": str(directory)}
    env.pop("VIRTUAL_ENV", None)  # the rehearsal builds its own
    # RC is written once the script is over (LOG complete); RC's absence means still running
    script = (
        f'nice -n 19 bash "$0" --quick >"$1/{LOG}" 2>&1; echo $? >"$1/{RC}.tmp"; mv "$1/{RC}.tmp" "$1/{RC}"'
    )
    process = subprocess.Popen(
        ["bash", "-c", script, str(REPO / "scripts" / "gpu_rehearse.sh"), str(directory)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: discard() ends all of it
    )
    return Rehearsal(directory, process)
