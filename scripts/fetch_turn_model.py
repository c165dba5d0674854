"""Puts smart-turn v3.2's weights where the server finds them (service/pipeline/turn_model.py).

The weights ship inside the `pipecat-ai` 1.14.0 wheel (BSD-2-Clause, Daily; the licence is copied beside
them). Only the .onnx file and the licence are taken, not pipecat's code: `pip download --no-deps` fetches
the wheel through the ordinary package index, and this extracts two members and checks the model's hash.
Idempotent: a present, matching file is left alone. Run by scripts/setup.sh.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from service.pipeline.turn_model import MODEL_FILE, MODEL_SHA256, PIPECAT_VERSION, default_model_path

_MEMBER = f"pipecat/audio/turn/smart_turn/data/{MODEL_FILE}"
_LICENSE = f"pipecat_ai-{PIPECAT_VERSION}.dist-info/licenses/LICENSE"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(out: Path, wheel: Path | None = None) -> Path:
    if out.is_file() and sha256(out) == MODEL_SHA256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp]
            subprocess.run([*pip, f"pipecat-ai=={PIPECAT_VERSION}"], check=True)
            wheel = next(Path(tmp).glob("pipecat_ai-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            partial = out.with_suffix(".part")
            partial.write_bytes(z.read(_MEMBER))
            (out.parent / "LICENSE-smart-turn").write_bytes(z.read(_LICENSE))
    if sha256(partial) != MODEL_SHA256:
        partial.unlink()
        raise SystemExit(f"{_MEMBER} in the pipecat-ai {PIPECAT_VERSION} wheel does not match its known hash")
    partial.replace(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a pipecat-ai wheel already downloaded")
    parser.add_argument("--out", type=Path, default=default_model_path())
    args = parser.parse_args()
    print(fetch(args.out, args.wheel))


if __name__ == "__main__":
    main()
