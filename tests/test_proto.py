"""The committed Python code in proto/asr/v1 is what scripts/gen_proto.sh makes from asr.proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERATED = ("asr_pb2.py", "asr_pb2.pyi", "asr_pb2_grpc.py")


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}  # this venv's grpcio-tools, activated or not
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=REPO, env=env
    )
    stale = [
        name
        for name in GENERATED
        if (tmp_path / "asr" / "v1" / name).read_text() != (REPO / "proto" / "asr" / "v1" / name).read_text()
    ]
    assert not stale, f"run scripts/gen_proto.sh and commit: {stale}"
