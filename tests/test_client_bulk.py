"""`asr-client FOLDER --out DIR`: bulk transcription of real recordings through a real server, resumable,
a failed file reported without stopping the others."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from clients.scoring import normalize
from tests.support.audio import (
    JFK_FLAC,
    RATE,
    _sox_to_raw,
    make_conversation,
    speak,
    stereo,
    to_mulaw_8k_bytes,
)
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow
CLIENT = str(Path(sys.executable).with_name("asr-client"))
AGENT = "Thank you for calling the billing department."
CUSTOMER = "I would like to cancel my subscription."
HOLD = "Please hold while I transfer your call."


def run_client(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLIENT, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """jfk.flac, an espeak-ng WAV, a mu-law 8 kHz telephone file, an agent/customer stereo WAV in a
    sub-folder, and a file that only looks like a WAV."""
    folder = tmp_path_factory.mktemp("recordings")
    (folder / "jfk.flac").write_bytes(JFK_FLAC.read_bytes())
    sf.write(folder / "hold.wav", speak(HOLD), RATE, subtype="PCM_16")
    (folder / "phone.ulaw").write_bytes(to_mulaw_8k_bytes(speak(HOLD)))
    agent, _ = make_conversation([AGENT], pause_s=0.8)
    customer, _ = make_conversation([CUSTOMER], pause_s=0.8, lead_s=len(agent) / RATE)
    (folder / "calls").mkdir()
    sf.write(folder / "calls" / "call1.wav", stereo(agent, customer).T, RATE, subtype="PCM_16")
    (folder / "broken.wav").write_bytes(b"RIFF" + bytes(range(200)))
    return folder


def bulk(folder: Path, out: Path, target: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_client(str(folder), "--out", str(out), "--server", target, "--concurrency", "2", *extra)


def srt_text(path: Path) -> str:
    cues = re.findall(r"^\d+\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n(.+)$", path.read_text(), re.M)
    assert cues, path.read_text()
    return " ".join(cues)


def test_folder_to_json_and_srt_resumable_and_a_failure_reported(
    asr_server: ServerThread, recordings: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = bulk(recordings, out, asr_server.target, "--separate-channels")
    assert first.returncode == 1, first.stderr  # one file failed
    assert re.search(r"failed: broken\.wav: INVALID_ARGUMENT: .*not a valid WAV", first.stderr), first.stderr
    assert "5 recordings: 4 transcribed, 0 skipped (already done), 1 failed" in first.stderr
    assert not (out / "broken.wav.json").exists() and not (out / "broken.wav.srt").exists()

    jfk = json.loads((out / "jfk.flac.json").read_text())
    assert jfk["file"] == "jfk.flac" and jfk["method"] == "recognize"
    assert "ask not what your country can do for you" in normalize(jfk["text"])
    assert jfk["results"] and all("segments" in r["alternatives"][0] for r in jfk["results"])
    assert "ask not what your country" in normalize(srt_text(out / "jfk.flac.srt"))
    for name in ("hold.wav", "phone.ulaw"):
        record = json.loads((out / f"{name}.json").read_text())
        assert "transfer your call" in normalize(record["text"]), record
        assert "transfer your call" in normalize(srt_text(out / f"{name}.srt"))

    call = json.loads((out / "calls" / "call1.wav.json").read_text())
    by_speaker = {r["speaker"]: r["alternatives"][0]["transcript"] for r in call["results"]}
    assert set(by_speaker) == {"agent", "customer"}
    assert "billing department" in normalize(by_speaker["agent"])
    assert "cancel my subscription" in normalize(by_speaker["customer"])
    call_srt = srt_text(out / "calls" / "call1.wav.srt")
    assert call_srt.index("[agent]") < call_srt.index("[customer]")

    # A rerun skips what is done (outputs untouched) and retries only the failure.
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    second = bulk(recordings, out, asr_server.target, "--separate-channels")
    assert second.returncode == 1
    assert "5 recordings: 0 transcribed, 4 skipped (already done), 1 failed" in second.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], "no temporary file is left behind"

    # A file whose outputs are incomplete (one missing) is done again; with the broken one gone, exit 0.
    (out / "hold.wav.srt").unlink()
    (recordings / "broken.wav").unlink()
    third = bulk(recordings, out, asr_server.target, "--separate-channels")
    assert third.returncode == 0, third.stderr
    assert "4 recordings: 1 transcribed, 3 skipped (already done), 0 failed" in third.stderr
    assert "transfer your call" in normalize(srt_text(out / "hold.wav.srt"))


def test_files_over_max_recognize_bytes_are_streamed(asr_server: ServerThread, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    sf.write(folder / "hold.wav", speak(HOLD), RATE, subtype="PCM_16")
    sf.write(folder / "quiet.wav", np.zeros(RATE, dtype=np.float32), RATE, subtype="PCM_16")
    out = tmp_path / "out"
    proc = bulk(folder, out, asr_server.target, "--max-recognize-bytes", "1000", "--stream-speed", "0")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "hold.wav.json").read_text())
    assert record["method"] == "stream"
    assert "transfer your call" in normalize(record["text"])
    assert record["results"][0]["alternatives"][0]["segments"]
    assert "transfer your call" in normalize(srt_text(out / "hold.wav.srt"))
    silent = json.loads((out / "quiet.wav.json").read_text())
    assert silent["results"] == [] and silent["text"] == ""
    assert (out / "quiet.wav.srt").read_text() == ""


def test_a_folder_needs_out(asr_server: ServerThread, tmp_path: Path) -> None:
    proc = run_client(str(tmp_path), "--server", asr_server.target)
    assert proc.returncode != 0 and "--out" in proc.stderr


def test_raw_alaw_at_the_rate_flag(asr_server: ServerThread, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "wideband.alaw").write_bytes(_sox_to_raw(speak(HOLD), RATE, 16000, "a-law"))
    out = tmp_path / "out"
    proc = bulk(folder, out, asr_server.target, "--rate", "16000")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "wideband.alaw.json").read_text())
    assert "transfer your call" in normalize(record["text"])
    assert 2.0 < float(record["total_audio_duration"].rstrip("s")) < 4.0  # read at 16 kHz, not 8 kHz


def test_progress_bar_on_a_terminal(asr_server: ServerThread, tmp_path: Path) -> None:
    """On a terminal (a pseudo-terminal from util-linux `script`, 100x30) the bar counts the recordings."""
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        sf.write(folder / f"hold{i}.wav", speak(HOLD), RATE, subtype="PCM_16")
    command = (
        f"stty cols 100 rows 30; {CLIENT} {folder} --out {tmp_path / 'out'} --server {asr_server.target}"
    )
    proc = subprocess.run(
        ["script", "-qec", command, "/dev/null"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout
    assert re.search(r"100%\|.*\| 3/3 \[", proc.stdout), proc.stdout
    assert "3 recordings: 3 transcribed" in proc.stdout
