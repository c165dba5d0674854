"""`asr-client FOLDER --out DIR`: bulk transcription of real recordings through a real server, resumable,
a failed file (transcription or write) reported without stopping the others; outputs private, never
through a link, complete or absent (a server draining mid-file: continued elsewhere, or failed and redone),
and redone when the input or an option changed; redaction and WAVE_FORMAT_EXTENSIBLE inputs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
from asr.v1 import asr_pb2, asr_pb2_grpc

from clients.bulk import BulkOptions, OutputError, resume_point, stream_whole, write_outputs
from clients.client import STREAM_ID_HEADER, RecognizerClient
from clients.scoring import normalize
from engine import Engine
from service.config import ServerConfig
from tests.support.audio import (
    JFK_FLAC,
    RATE,
    _sox_to_raw,
    make_conversation,
    speak,
    stereo,
    to_mulaw_8k_bytes,
)
from tests.support.server import ServerProcess, ServerThread

pytestmark = pytest.mark.slow
CLIENT = str(Path(sys.executable).with_name("asr-client"))
AGENT = "Thank you for calling the billing department."
CUSTOMER = "I would like to cancel my subscription."
HOLD = "Please hold while I transfer your call."


def run_client(*args: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """asr-client; with `file_size_limit`, the kernel refuses any write past that many bytes (EFBIG,
    RLIMIT_FSIZE set by util-linux prlimit: what a full disk's ENOSPC is to the writer, without needing a
    small file system). No preexec_fn: forking this gRPC-using process to run Python in the child can
    abort the child in gRPC's fork handlers."""
    limit = ["prlimit", f"--fsize={file_size_limit}", "--"] if file_size_limit is not None else []
    return subprocess.run([*limit, CLIENT, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """jfk.flac, jfk as a 24-bit stereo WAVE_FORMAT_EXTENSIBLE WAV (sox), an espeak-ng WAV, a mu-law 8 kHz
    telephone file, an agent/customer stereo WAV in a sub-folder, and a file that only looks like a WAV."""
    folder = tmp_path_factory.mktemp("recordings")
    (folder / "jfk.flac").write_bytes(JFK_FLAC.read_bytes())
    subprocess.run(["sox", "-D", str(JFK_FLAC), "-b", "24", str(folder / "jfk24.wav")], check=True)
    assert (folder / "jfk24.wav").read_bytes()[20:22] == b"\xfe\xff"  # WAVE_FORMAT_EXTENSIBLE
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
    assert "6 recordings: 5 transcribed, 0 skipped (already done), 1 failed" in first.stderr
    assert not (out / "broken.wav.json").exists() and not (out / "broken.wav.srt").exists()

    jfk = json.loads((out / "jfk.flac.json").read_text())
    assert jfk["file"] == "jfk.flac" and jfk["method"] == "recognize" and jfk["complete"] is True
    assert "ask not what your country can do for you" in normalize(jfk["text"])
    assert jfk["results"] and all("segments" in r["alternatives"][0] for r in jfk["results"])
    assert "ask not what your country" in normalize(srt_text(out / "jfk.flac.srt"))
    # What it was made from: the input's size, mtime and content hash, and the options.
    made_from = jfk["made_from"]
    st = (recordings / "jfk.flac").stat()
    assert (made_from["size"], made_from["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    assert made_from["sha256"] == hashlib.sha256((recordings / "jfk.flac").read_bytes()).hexdigest()
    assert made_from["options"]["separate_channels"] is True and made_from["options"]["redact"] == []
    wavex = json.loads((out / "jfk24.wav.json").read_text())  # WAVE_FORMAT_EXTENSIBLE, both channels
    assert {r["speaker"] for r in wavex["results"]} == {"agent", "customer"}
    assert "ask not what your country can do for you" in normalize(wavex["text"])
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
    # Transcripts are private: files 0600, the folders the client made 0700.
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()} == {0o600}
    assert stat.S_IMODE((out / "calls").stat().st_mode) == 0o700

    # A rerun skips what is done (outputs untouched) and retries only the failure.
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    second = bulk(recordings, out, asr_server.target, "--separate-channels")
    assert second.returncode == 1
    assert "6 recordings: 0 transcribed, 5 skipped (already done), 1 failed" in second.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], "no temporary file is left behind"

    # A file whose outputs are incomplete (one missing, or not the one written with the JSON) is done
    # again; with the broken one gone, exit 0.
    (out / "hold.wav.srt").unlink()
    (out / "phone.ulaw.srt").write_text("1\n00:00:00,000 --> 00:00:01,000\nedited\n")
    (recordings / "broken.wav").unlink()
    third = bulk(recordings, out, asr_server.target, "--separate-channels")
    assert third.returncode == 0, third.stderr
    assert "5 recordings: 2 transcribed, 3 skipped (already done), 0 failed" in third.stderr
    assert "transfer your call" in normalize(srt_text(out / "hold.wav.srt"))
    assert "transfer your call" in normalize(srt_text(out / "phone.ulaw.srt"))


def test_a_changed_input_or_option_is_done_again(asr_server: ServerThread, tmp_path: Path) -> None:
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    sf.write(folder / "a.wav", speak(HOLD), RATE, subtype="PCM_16")
    sf.write(folder / "b.wav", speak(AGENT), RATE, subtype="PCM_16")
    assert bulk(folder, out, asr_server.target).returncode == 0
    # Same size, same mtime, other words: only the content hash tells.
    before = (folder / "a.wav").stat()
    other = speak(CUSTOMER)
    sf.write(folder / "a.wav", np.resize(other, len(speak(HOLD))), RATE, subtype="PCM_16")
    os.utime(folder / "a.wav", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (folder / "a.wav").stat().st_size == before.st_size
    # b.wav touched only (a copy, a restore): same content, not redone.
    os.utime(folder / "b.wav")
    again = bulk(folder, out, asr_server.target)
    assert "2 recordings: 1 transcribed, 1 skipped (already done), 0 failed" in again.stderr, again.stderr
    assert "cancel my subscription" in normalize(json.loads((out / "a.wav.json").read_text())["text"])
    # Another option that shapes the transcript redoes everything; the same options again skip it.
    assert "2 recordings: 2 transcribed" in bulk(folder, out, asr_server.target, "--language", "en").stderr
    assert (
        "2 recordings: 0 transcribed, 2 skipped"
        in bulk(folder, out, asr_server.target, "--language", "en").stderr
    )
    # An output of an older client (no record of what it was made from) is redone too.
    record = json.loads((out / "a.wav.json").read_text())
    del record["made_from"]
    (out / "a.wav.json").write_text(json.dumps(record))
    assert "1 transcribed, 1 skipped" in bulk(folder, out, asr_server.target, "--language", "en").stderr


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


def test_a_failed_write_fails_that_file_not_the_job(asr_server: ServerThread, tmp_path: Path) -> None:
    """An output name too long for the file system, a write the kernel refuses (the file-size limit:
    EFBIG, as ENOSPC on a full disk), an output that is a symbolic link and a folder that is one: each
    fails its own recording, nothing is written through the links, the other recording is done."""
    folder, out, elsewhere = tmp_path / "in", tmp_path / "out", tmp_path / "elsewhere"
    for d in (folder, folder / "sub", out, elsewhere):
        d.mkdir()
    hold = speak(HOLD)
    long_name = "n" * 250 + ".wav"  # 254 bytes: a valid name; "<name>.json" is 259, over NAME_MAX
    for name in ("ok.wav", long_name, "linked.wav", "sub/inside.wav"):
        sf.write(folder / name, hold, RATE, subtype="PCM_16")
    (folder / "jfk.flac").write_bytes(JFK_FLAC.read_bytes())  # its JSON (~2.7 KB) is over the limit below
    target = elsewhere / "planted.json"
    target.write_text("untouched")
    (out / "linked.wav.json").symlink_to(target)
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)

    proc = run_client(
        str(folder), "--out", str(out), "--server", asr_server.target, "--concurrency", "2",
        file_size_limit=2000,  # ok.wav's JSON is ~1.2 KB
    )  # fmt: skip
    print(proc.stderr)
    assert proc.returncode == 1
    assert "5 recordings: 1 transcribed, 0 skipped (already done), 4 failed" in proc.stderr
    assert re.search(rf"failed: {long_name}: could not write .*\.(srt|json): File name too long", proc.stderr)
    assert re.search(r"failed: jfk\.flac: could not write .*jfk\.flac\.json: File too large", proc.stderr)
    assert re.search(
        r"failed: linked\.wav: could not write .*linked\.wav\.json: a symbolic link: refused", proc.stderr
    )
    assert re.search(r"failed: sub/inside\.wav: could not write \S*/out/sub: not a folder", proc.stderr)
    assert target.read_text() == "untouched" and sorted(p.name for p in elsewhere.iterdir()) == [
        "planted.json"
    ]
    assert "transfer your call" in normalize(json.loads((out / "ok.wav.json").read_text())["text"])
    # A failed recording leaves nothing under its names (the planted link itself is removed, its target
    # untouched): no half output, no temporary file.
    assert sorted(p.name for p in out.iterdir()) == ["ok.wav.json", "ok.wav.srt", "sub"]


def test_redaction_reaches_every_bulk_output(asr_server: ServerThread, tmp_path: Path) -> None:
    """--redact pci: a misheard card number (tiny.en on espeak 8 kHz mu-law) is masked in the JSON and the
    SRT, sent whole (Recognize) and streamed; without it the digits are in the outputs."""
    folder = tmp_path / "in"
    folder.mkdir()
    audio, _ = make_conversation(
        ["Yes, my card number is 4 8 1 0, 0 0 3 3, 9 0 0 5, 5 9 3 8.", "Thank you."], pause_s=1.0
    )
    (folder / "card.ulaw").write_bytes(to_mulaw_8k_bytes(audio))
    for extra in ((), ("--max-recognize-bytes", "1000", "--stream-speed", "0")):
        out = tmp_path / f"out{len(extra)}"
        proc = bulk(folder, out, asr_server.target, "--redact", "pci", *extra)
        assert proc.returncode == 0, proc.stderr
        record = json.loads((out / "card.ulaw.json").read_text())
        assert record["made_from"]["options"]["redact"] == ["PCI"]
        alts = [a for r in record["results"] for a in r["alternatives"]]
        strings = [
            record["text"],
            *(a["transcript"] for a in alts),
            *(s["text"] for a in alts for s in a["segments"]),
            *(w["word"] for a in alts for w in a.get("words", [])),
            srt_text(out / "card.ulaw.srt"),
        ]
        assert "[PCI]" in record["text"], record["text"]
        for text in strings:
            assert not re.search(r"\d", text), text
    plain = bulk(folder, tmp_path / "plain", asr_server.target)
    assert plain.returncode == 0
    assert (
        len(re.findall(r"\d", json.loads((tmp_path / "plain" / "card.ulaw.json").read_text())["text"])) > 10
    )


# --- the server drains mid-file (every rollout) ---------------------------------------------------------

SENTENCES = [
    "Thank you for calling the billing department.",
    "I would like to cancel my subscription.",
    "Please hold while I transfer your call.",
    "It was placed last week and it has not arrived yet.",
    "Can you send me a new invoice by email please.",
    "Thank you very much and goodbye.",
]
KEYS = [
    "billing department",
    "cancel my subscription",
    "transfer your call",
    "last week",  # "placed" is heard as "place" with the int8 encoder: the sentence is what counts
    "new invoice",
    "goodbye",
]


@pytest.fixture(scope="module")
def long_call(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20-odd second call as a WAV in a folder of its own: streamed (over --max-recognize-bytes 1000)."""
    folder = tmp_path_factory.mktemp("long")
    audio, _ = make_conversation(SENTENCES, pause_s=1.2)
    sf.write(folder / "call.wav", audio, RATE, subtype="PCM_16")
    return folder


def start_bulk(folder: Path, out: Path, target: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [CLIENT, str(folder), "--out", str(out), "--server", target, "--max-recognize-bytes", "1000", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {within_s} s")
        time.sleep(0.1)


def each_once(text: str) -> dict[str, int]:
    t = normalize(text)
    return {k: t.count(k) for k in KEYS}


def test_a_stream_drained_mid_file_is_continued_on_another_replica(
    asr_server: ServerThread, long_call: Path, tmp_path: Path
) -> None:
    """Two replicas behind one name (a gRPC ipv4: address list: pick_first, as behind a Service). The
    first, a real asr-server, gets SIGTERM while the file streams: it sends RECONNECT with how much it
    heard and the finals of that; the client continues from there on the other replica. The output is
    the whole call, every sentence once, with the file's duration and offsets."""
    first = ServerProcess("--drain-seconds", "10").wait_serving()
    try:
        out = tmp_path / "out"
        client = start_bulk(
            long_call,
            out,
            f"ipv4:{first.target},{asr_server.target}",
            "--stream-speed",
            "1",  # real time: ~25 s, so the drain comes mid-file even on a loaded machine
            "--retries",
            "5",
        )
        # Two finals: the drain can come right behind a speculative final, within CUT_SLACK_S of where the
        # replica stopped hearing, and the client then rightly redoes that utterance from its start.
        wait_for(
            lambda: first.log().count('"message": "utterance"') >= 2, 60, "two finals on the first replica"
        )
        assert client.poll() is None, "the file must still be streaming when the drain comes"
        first.terminate()
        _, stderr = client.communicate(timeout=180)
        assert first.wait(60) == 0
    finally:
        first.stop()
    assert client.returncode == 0, stderr
    assert "1 recordings: 1 transcribed" in stderr
    record = json.loads((out / "call.wav.json").read_text())
    duration = sf.info(long_call / "call.wav").duration
    assert record["complete"] is True and record["method"] == "stream"
    assert abs(float(record["total_audio_duration"].rstrip("s")) - duration) < 0.01
    (resumed,) = record["resumed_at_s"]  # continued once, from where the first replica stopped hearing
    assert 1.0 < resumed < duration - 1.0, (resumed, duration)
    assert each_once(record["text"]) == dict.fromkeys(KEYS, 1), record["text"]
    starts = [float(r["start_offset"].rstrip("s")) for r in record["results"]]
    assert starts == sorted(starts) and starts[-1] > resumed  # the later finals carry the file's times
    assert any(s < resumed for s in starts)


async def test_a_drained_file_that_cannot_be_continued_fails_and_a_rerun_redoes_it(
    service_engine: Engine, asr_server: ServerThread, long_call: Path, tmp_path: Path
) -> None:
    """The only replica drains mid-file and goes away: the client says how far it got and fails the file
    (no output: never a truncated transcript with the whole file's duration); a rerun redoes it whole."""
    server = ServerThread(ServerConfig(), service_engine).start()
    out = tmp_path / "out"
    client = start_bulk(long_call, out, server.target, "--stream-speed", "1", "--retries", "1")
    try:

        async def heard_s() -> float:
            return max((s.heard_s for s in server.server.recognizer.sessions), default=0.0)

        await asyncio.to_thread(wait_for, lambda: server.call(heard_s()) > 5.0, 60, "5 s of the call heard")
        server.loop.call_soon_threadsafe(server.server.recognizer.drain)  # RECONNECT, as on SIGTERM
        await asyncio.to_thread(
            wait_for,
            lambda: not server.call(heard_s()) and not server.server.recognizer.sessions,
            30,
            "drained",
        )
    finally:
        server.stop()
    _, stderr = await asyncio.to_thread(client.communicate, timeout=120)
    assert client.returncode == 1, stderr
    assert re.search(r"failed: call\.wav: incomplete: transcribed [0-9.]+ s of [0-9.]+ s", stderr), stderr
    assert not out.exists() or not list(out.iterdir())
    again = await asyncio.to_thread(
        run_client, str(long_call), "--out", str(out), "--server", asr_server.target,
        "--max-recognize-bytes", "1000", "--stream-speed", "0",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    record = json.loads((out / "call.wav.json").read_text())
    assert record["resumed_at_s"] == [] and each_once(record["text"]) == dict.fromkeys(KEYS, 1)


# --- outputs on disk, without a server -----------------------------------------------------------------


def test_outputs_are_0600_whatever_the_umask_and_replace_atomically(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_outputs(tmp_path, Path("a/b"), [("x.srt", b"one"), ("x.json", b"two")])
    finally:
        os.umask(old)
    assert (tmp_path / "a/b/x.json").read_bytes() == b"two"
    assert stat.S_IMODE((tmp_path / "a/b/x.srt").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    write_outputs(tmp_path, Path("a/b"), [("x.json", b"three")])
    assert (tmp_path / "a/b/x.json").read_bytes() == b"three"
    assert sorted(p.name for p in (tmp_path / "a/b").iterdir()) == ["x.json", "x.srt"]


def test_outputs_are_never_written_through_a_link(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "x.json").symlink_to(elsewhere / "x.json")
    with pytest.raises(OutputError, match="symbolic link"):
        write_outputs(out, Path("."), [("x.json", b"secret")])
    (out / "deep").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(OutputError, match="not a folder"):
        write_outputs(out, Path("deep"), [("y.json", b"secret")])
    assert not list(elsewhere.iterdir())


def _final(start_s: float, end_s: float, tag: int = 0) -> asr_pb2.StreamingRecognitionResult:
    result = asr_pb2.StreamingRecognitionResult(is_final=True, channel_tag=tag)
    result.start_offset.FromNanoseconds(round(start_s * 1e9))
    result.end_offset.FromNanoseconds(round(end_s * 1e9))
    return result


def test_a_drain_cut_utterance_is_redone_whole_on_the_next_stream() -> None:
    done, cut = _final(0.5, 2.0), _final(3.0, 4.98)
    # Heard up to 5.0 s, the second utterance still being spoken: it is dropped, the next stream starts
    # where it began (no sentence split mid-word, nothing said twice).
    assert resume_point([done, cut], 5.0) == ([done], 3.0)
    # Nothing was being said at the drain: go on from where the server stopped hearing.
    assert resume_point([done], 5.0) == ([done], 5.0)
    # Another channel's final that runs past the new start goes too, and the start moves before it.
    other = _final(2.5, 3.5, tag=2)
    assert resume_point([done, other, cut], 5.0) == ([done], 2.5)
    # A stream that failed (no RECONNECT): its finals are whole; go on after the last.
    assert resume_point([done, cut], None) == ([done, cut], 4.98)


def test_the_json_carries_the_call_metrics_recognized_and_streamed(
    asr_server: ServerThread, tmp_path: Path
) -> None:
    """Recognize's call_metrics, and a streamed file's (its stream's last response), in the JSON output."""
    folder = tmp_path / "in"
    folder.mkdir()
    agent, _ = make_conversation([AGENT], pause_s=0.8)
    customer, _ = make_conversation([CUSTOMER], pause_s=0.8, lead_s=len(agent) / RATE)
    sf.write(folder / "call.wav", stereo(agent, customer).T, RATE, subtype="PCM_16")
    for extra, method in (
        ((), "recognize"),
        (("--max-recognize-bytes", "1000", "--stream-speed", "0"), "stream"),
    ):
        out = tmp_path / f"out-{method}"
        proc = bulk(folder, out, asr_server.target, "--separate-channels", *extra)
        assert proc.returncode == 0, proc.stderr
        record = json.loads((out / "call.wav.json").read_text())
        assert record["method"] == method
        m = record["call_metrics"]
        total = max(len(agent), len(customer)) / RATE
        assert float(m["total_time"].rstrip("s")) == pytest.approx(total, abs=0.05), m
        assert [c["channel_tag"] for c in m["channels"]] == [1, 2], m
        for c in m["channels"]:
            assert float(c["talk_time"].rstrip("s")) > 1.0 and c["words_per_minute"] > 0, m


class _CutThenWhole(asr_pb2_grpc.RecognizerServicer):
    """A replica whose first stream ends as grpc.aio ends one when the server closes while the client is
    writing (INTERNAL "Internal error from Core", grpc/grpc#36066), after one final; later streams are
    heard to the end, one final each."""

    def __init__(self) -> None:
        self.calls = 0

    async def StreamingRecognize(
        self, requests: AsyncIterator[asr_pb2.StreamingRecognizeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[asr_pb2.StreamingRecognizeResponse]:
        self.calls += 1
        await context.send_initial_metadata(((STREAM_ID_HEADER, f"s{self.calls}"),))
        response = asr_pb2.StreamingRecognizeResponse()
        final = response.results.add(is_final=True)
        final.alternatives.add(transcript=f"stream {self.calls}")
        final.start_offset.FromNanoseconds(500_000_000)
        final.end_offset.FromNanoseconds(2_000_000_000)
        if self.calls == 1:
            yield response
            await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
        async for _ in requests:
            pass
        yield response


async def test_a_stream_cut_by_the_write_race_is_continued_after_its_last_final(tmp_path: Path) -> None:
    servicer = _CutThenWhole()
    server = grpc.aio.server()
    asr_pb2_grpc.add_RecognizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    path = tmp_path / "call.wav"
    sf.write(path, np.zeros(5 * RATE, dtype=np.int16), RATE, subtype="PCM_16")
    client = RecognizerClient(f"127.0.0.1:{port}")
    try:
        response, resumed_at = await stream_whole(client, path, BulkOptions(tmp_path, stream_speed=0))
    finally:
        await client.close()
        await server.stop(None)
    assert servicer.calls == 2
    assert resumed_at == [2.0]
    assert [r.alternatives[0].transcript for r in response.results] == ["stream 1", "stream 2"]
