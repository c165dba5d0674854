"""asr-client (the console script) against asr-server (a subprocess): what a person at a terminal sees."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.scoring import normalize
from tests.support.audio import JFK_FLAC, make_conversation, to_mulaw_8k_bytes
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow
CLIENT = str(Path(sys.executable).with_name("asr-client"))


def run_client(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLIENT, *args], capture_output=True, text=True, timeout=120)


def test_cli_streams_jfk_flac_and_prints_the_text(server_process: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    proc = run_client(str(JFK_FLAC), "--server", server_process.target, "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = normalize(proc.stdout)
    assert "my fellow americans" in text
    assert "ask not what your country can do for you" in text
    assert "[00:00." in proc.stdout  # offsets printed with each final
    records = [json.loads(line) for line in out.read_text().splitlines()]
    finals = [r for r in records if r["type"] == "final"]
    assert finals and all(r["end_s"] > r["start_s"] for r in finals)
    assert normalize(" ".join(r["transcript"] for r in finals)) in text
    assert {"SPEECH_ACTIVITY_BEGIN", "SPEECH_ACTIVITY_END"} <= {
        r["event"] for r in records if r["type"] == "event"
    }


def test_cli_recognize_and_interims_on_a_pipe(server_process: ServerProcess, tmp_path: Path) -> None:
    whole = run_client(str(JFK_FLAC), "--server", server_process.target, "--recognize")
    assert whole.returncode == 0, whole.stderr
    assert "ask not what your country can do for you" in normalize(whole.stdout)

    import soundfile as sf

    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    ulaw = tmp_path / "jfk.ulaw"
    ulaw.write_bytes(to_mulaw_8k_bytes(audio.mean(axis=1), rate))
    streamed = run_client(str(ulaw), "--server", server_process.target, "--interim", "--realtime")
    assert streamed.returncode == 0, streamed.stderr
    lines = streamed.stdout.splitlines()
    assert any(line.startswith("… [") for line in lines), "interims print as their own lines on a pipe"
    assert "ask what you can do for your country" in normalize(" ".join(lines[-2:]))


def test_cli_reports_a_refusal_and_exits_non_zero(server_process: ServerProcess, tmp_path: Path) -> None:
    proc = run_client(str(JFK_FLAC), "--server", server_process.target, "--language", "xx")
    assert proc.returncode != 0
    assert "INVALID_ARGUMENT" in proc.stderr and "language_code" in proc.stderr


def test_metrics_endpoint_serves_build_model_and_grpc_metrics(server_process: ServerProcess) -> None:
    run_client(str(JFK_FLAC), "--server", server_process.target, "--recognize")
    with urllib.request.urlopen(f"http://127.0.0.1:{server_process.metrics_port}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    build = families["asr_build_info"].samples[0]
    assert set(build.labels) == {"version", "revision"}
    model = families["asr_model_info"].samples[0].labels
    assert "tiny.en" in model["model"] and model["device"] and model["dtype"]
    handled = [
        s
        for s in families["grpc_server_handled"].samples
        if s.labels["grpc_method"] == "Recognize" and s.labels["grpc_code"] == "OK"
    ]
    assert handled and handled[0].value >= 1
    assert "process_resident_memory_bytes" in families
    assert "asr_kv_cache_bytes" in families and "asr_active_streams" in families


def test_server_logs_are_json_lines_with_per_utterance_facts_and_no_text(
    server_process: ServerProcess,
) -> None:
    assert run_client(str(JFK_FLAC), "--server", server_process.target).returncode == 0
    lines = [json.loads(line) for line in server_process.log().splitlines() if line.strip()]  # all JSON
    ready = next(x for x in lines if x["message"] == "model ready")
    assert ready["kv_cache_bytes"] > 0
    utterances = [x for x in lines if x["message"] == "utterance"]
    assert utterances
    for x in utterances:
        assert {
            "stream_id",
            "utterance_id",
            "channel",
            "audio_s",
            "queue_wait_s",
            "encoder_batch_size",
        } <= set(x)
        assert {"decode_steps", "latency_s", "outcome", "severity", "time"} <= set(x)
        assert "transcript" not in x  # no speech content in logs unless --log-transcripts
    assert "fellow" not in server_process.log().lower()


def test_cli_asks_for_redaction_streamed_and_recognized(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    """`--redact pci`: a card number tiny.en mishears on espeak 8 kHz mu-law is masked in what asr-client
    prints and writes, streamed and with --recognize; without it the digits show."""
    audio, _ = make_conversation(["Yes, my card number is 4 8 1 0, 0 0 3 3, 9 0 0 5, 5 9 3 8."], pause_s=1.0)
    card = tmp_path / "card.ulaw"
    card.write_bytes(to_mulaw_8k_bytes(audio))

    def transcripts(stdout: str) -> list[str]:
        return [re.sub(r"^\[[^]]*\] ", "", line) for line in stdout.splitlines() if line.startswith("[")]

    for mode in ((), ("--recognize",)):
        jsonl = tmp_path / f"out{len(mode)}.jsonl"
        proc = run_client(
            str(card), "--server", server_process.target, "--redact", "pci", "--json-out", str(jsonl), *mode
        )
        assert proc.returncode == 0, proc.stderr
        printed = transcripts(proc.stdout)
        assert printed and any("[PCI]" in t for t in printed), proc.stdout
        assert not any(re.search(r"\d", t) for t in printed), printed
        if not mode:
            written = [
                json.loads(line)["transcript"]
                for line in jsonl.read_text().splitlines()
                if '"transcript"' in line
            ]
            assert written and not any(re.search(r"\d", t) for t in written), written
        plain = run_client(str(card), "--server", server_process.target, *mode)
        assert len(re.findall(r"\d", " ".join(transcripts(plain.stdout)))) > 10, plain.stdout


def test_cli_refuses_an_unknown_redaction_naming_the_flag(tmp_path: Path) -> None:
    proc = run_client(str(tmp_path), "--redact", "pci,cvv")
    assert proc.returncode == 2
    assert "--redact" in proc.stderr and "'cvv'" in proc.stderr and "pci, ssn, numbers" in proc.stderr


def test_cli_prints_the_call_metrics_and_asks_for_smart_formatting_and_keyterms(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    """One file, streamed and with --recognize: a `# call metrics:` line after the finals (and a JSON line
    with every figure); --formatting smart writes the spelled-out order number as digits; --keyterms
    reaches the server (a list past its bounds is refused, naming config.keyterms)."""
    audio, _ = make_conversation(
        ["The order number is one two three four five six."], pause_s=1.0, voice="en-gb", speed=160
    )
    clip = tmp_path / "order.ulaw"
    clip.write_bytes(to_mulaw_8k_bytes(audio))
    for mode in ((), ("--recognize",)):
        jsonl = tmp_path / f"out{len(mode)}.jsonl"
        proc = run_client(
            str(clip), "--server", server_process.target, "--formatting", "smart", "--json-out", str(jsonl),
            "--keyterms", "Kestoria, Moxilar", *mode,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[-1].startswith("# call metrics: ") and "ch0 talk" in lines[-1], proc.stdout
        assert "123456" in proc.stdout, proc.stdout
        metrics = [json.loads(line) for line in jsonl.read_text().splitlines() if '"call_metrics"' in line]
        assert len(metrics) == 1 and metrics[0]["channels"][0]["words_per_minute"] > 0, metrics
    plain = run_client(str(clip), "--server", server_process.target)
    assert "123456" not in plain.stdout, plain.stdout
    refused = run_client(str(clip), "--server", server_process.target, "--keyterms", ",".join(["x"] * 101))
    assert refused.returncode != 0 and "config.keyterms" in refused.stderr, refused.stderr
