"""A client we did not write: `buf curl` (npm @bufbuild/buf) finds the API through server
reflection, checks health and transcribes jfk.flac through Recognize."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest

from clients.scoring import normalize
from tests.support.audio import JFK_FLAC
from tests.support.server import ServerThread

BUF = Path(__file__).resolve().parent / "tools" / "node_modules" / ".bin" / "buf"


def buf_curl(server: ServerThread, *args: str, stdin: str | None = None) -> str:
    if not BUF.exists():
        pytest.fail(f"{BUF} missing: run scripts/setup.sh (npm ci in tests/tools)")
    command = [str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge", *args]
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_buf_lists_methods_through_reflection(asr_server: ServerThread) -> None:
    methods = buf_curl(asr_server, "--list-methods", f"http://{asr_server.target}").split()
    assert "asr.v1.Recognizer/StreamingRecognize" in methods
    assert "asr.v1.Recognizer/Recognize" in methods
    # every door's service is described, not only listed (Google's package carries no service descriptor)
    assert {
        "nvidia.riva.asr.RivaSpeechRecognition/StreamingRecognize",
        "google.cloud.speech.v1.Speech/StreamingRecognize",
        "google.cloud.speech.v1.Speech/LongRunningRecognize",
    } <= set(methods), methods


def test_buf_checks_health(asr_server: ServerThread) -> None:
    url = f"http://{asr_server.target}/grpc.health.v1.Health/Check"
    out = buf_curl(asr_server, "-d", json.dumps({"service": "asr.v1.Recognizer"}), url)
    assert json.loads(out)["status"] == "SERVING"


def test_buf_recognizes_jfk_flac(asr_server: ServerThread) -> None:
    body = {"config": {"encoding": "FLAC"}, "audioContent": base64.b64encode(JFK_FLAC.read_bytes()).decode()}
    out = buf_curl(
        asr_server,
        "-d",
        "@-",
        f"http://{asr_server.target}/asr.v1.Recognizer/Recognize",
        stdin=json.dumps(body),
    )
    text = normalize(" ".join(r["alternatives"][0]["transcript"] for r in json.loads(out)["results"]))
    assert "my fellow americans" in text and "ask not what your country can do for you" in text
