"""The GPU check's CPU rehearsal (scripts/gpu_rehearse.sh --quick), started in the background as soon as
pytest has collected its test, at the lowest CPU priority.

It takes minutes (a fresh venv, two server boots) but leaves most of its time waiting on pip and on
servers starting; run at `nice 19` it takes only the CPU the rest of the suite leaves idle (most tests
stream audio in real time), so the suite does not wait for it end to end. Its test waits for the result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODE_ID = "tests/test_gpu_rehearsal.py::test_gpu_check_rehearsal_passes_offline"


@dataclass
class Rehearsal:
    process: subprocess.Popen[str]
    directory: Path  # GPU_REHEARSE_DIR: its copies and out1/out2

    def result(self, timeout_s: float) -> tuple[int, str]:
        """Exit status and the whole output (stdout and stderr), once it is over."""
        out, _ = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, out

    def discard(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()
        shutil.rmtree(self.directory, ignore_errors=True)


def start() -> Rehearsal:
    directory = Path(tempfile.mkdtemp(prefix="gpu-rehearse-"))
    env = {**os.environ, "GPU_REHEARSE_DIR": str(directory)}
    env.pop("VIRTUAL_ENV", None)  # the rehearsal builds its own
    process = subprocess.Popen(
        ["nice", "-n", "19", "bash", str(REPO / "scripts" / "gpu_rehearse.sh"), "--quick"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Rehearsal(process, directory)
