"""CI smoke of asr-loadgen: a real server on loopback, real espeak-ng speech, the real CLI entry point.

Keeps the tool from rotting: a few utterances at concurrency 2 must all come back, scored,
timed and written out as JSON, markdown and PNG. The benchmark figures themselves live in
docs/benchmarks.md, not here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from clients import loadgen
from clients.manifest import build_manifest, load_manifest
from clients.scoring import corpus_wer, normalize
from tests.support.server import ServerProcess, ServerThread, free_port

pytestmark = pytest.mark.slow

# Measured: 0.172 (5 of 29 words) for these 4 utterances (tiny.en, greedy, fp32: "subscription"
# heard as "time's prediction", the digit string split as "4572-91"). The bound leaves room for
# about two more words, not for garbage.
WER_BOUND = 0.25
SENT = 4  # 3 manifest utterances, cycled: one is sent twice, so both encodings run concurrently


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # alternating 16 kHz LINEAR16 and 8 kHz mu-law
    return build_manifest(tmp_path_factory.mktemp("manifest"), count=3, encodings=("LINEAR16", "MULAW"))


@pytest.fixture(scope="module")
def metrics_url() -> Iterator[str]:
    """The in-process server's metrics (prometheus_client's default registry), as asr-server serves them."""
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1")
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    thread.join(5)


@pytest.fixture(scope="module")
def smoke(
    asr_server: ServerThread, manifest: Path, metrics_url: str, tmp_path_factory: pytest.TempPathFactory
):
    out = tmp_path_factory.mktemp("loadgen")
    rc = loadgen.main(
        ["run", "--server", asr_server.target, "--manifest", str(manifest), "--concurrency", "2",
         "--utterances-per-level", str(SENT), "--metrics", metrics_url, "--warmup", "0",
         "--out", str(out), "--label", "smoke"]
    )  # fmt: skip
    return rc, out


def test_manifest_is_deterministic_and_complete(manifest: Path, tmp_path: Path) -> None:
    entries = load_manifest(manifest)
    assert [(e.encoding, e.sample_rate) for e in entries] == [
        ("LINEAR16", 16000),
        ("MULAW", 8000),
        ("LINEAR16", 16000),
    ]
    for e in entries:
        size = Path(e.audio).stat().st_size
        bytes_per_s = 8000 if e.encoding == "MULAW" else 32000
        assert 1.0 < size / bytes_per_s < 8.0, (e.audio, size)  # a spoken sentence, not an empty file
    again = load_manifest(build_manifest(tmp_path, count=3, encodings=("LINEAR16", "MULAW")))
    assert [e.text for e in again] == [e.text for e in entries]
    for a, b in zip(again, entries, strict=True):
        assert Path(a.audio).read_bytes() == Path(b.audio).read_bytes()


def test_run_reports_every_utterance(smoke: tuple[int, Path]) -> None:
    rc, out = smoke
    assert rc == 0
    result: dict[str, Any] = json.loads((out / "smoke.json").read_text())
    (level,) = result["levels"]
    assert level["concurrency"] == 2
    assert level["utterances"] == SENT and level["ok"] == SENT
    assert level["errors"] == {} and level["no_final"] == 0
    assert all(s["hypothesis"] for s in level["samples"])
    assert level["wer"] is not None and level["wer"] < WER_BOUND
    p50, p95, p99 = level["latency_p50_s"], level["latency_p95_s"], level["latency_p99_s"]
    assert 0 < p50 <= p95 <= p99
    assert level["utt_per_s"] > 0 and level["audio_s_per_s"] > level["utt_per_s"]  # utterances last > 1 s
    # read from the server's /metrics while the level ran
    assert level["peak_rss_bytes"] > 100 * 2**20
    costs = level["server_seconds_per_utterance"]
    assert costs["asr_encoder_seconds"] > 0 and costs["process_cpu_seconds"] > 0

    md = (out / "smoke.md").read_text()
    assert f"| 2 | {SENT} | {level['utt_per_s']:.2f} |" in md
    assert (out / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_table(smoke: tuple[int, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, out = smoke
    base = json.loads((out / "smoke.json").read_text())
    batched = json.loads(json.dumps(base))
    batched["levels"][0]["utt_per_s"] = base["levels"][0]["utt_per_s"] * 1.5
    (out / "batched.json").write_text(json.dumps(batched))
    assert (
        loadgen.main(["compare", str(out / "smoke.json"), str(out / "batched.json"), "--out", str(out)]) == 0
    )
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |"))
    assert "+50.0%" in row
    assert (out / "compare.png").exists()


def test_errors_are_counted_by_status(asr_server: ServerThread, manifest: Path, tmp_path: Path) -> None:
    # 4 kHz is below the API's 8 kHz floor: every stream must fail with INVALID_ARGUMENT, and be counted
    bad = tmp_path / "bad.jsonl"
    entry = load_manifest(manifest)[1]
    bad.write_text(
        json.dumps({"audio": entry.audio, "encoding": "MULAW", "sample_rate": 4000, "text": entry.text})
    )
    rc = loadgen.main(
        ["run", "--server", asr_server.target, "--manifest", str(bad), "--concurrency", "2",
         "--utterances-per-level", "3", "--warmup", "0", "--out", str(tmp_path), "--label", "bad"]
    )  # fmt: skip
    assert rc == 1
    (level,) = json.loads((tmp_path / "bad.json").read_text())["levels"]
    assert level["errors"] == {"INVALID_ARGUMENT": 3} and level["ok"] == 0


def test_wer_normalises_then_counts_words() -> None:
    assert normalize("I'd like to CANCEL, please!") == "i would like to cancel please"
    assert corpus_wer(["my account number is four five"], ["My account number is 45."]) == 0.0
    assert corpus_wer(["cancel my subscription", "yes"], ["cancel my prescription", ""]) == 0.5


def test_capacity_reports_cpu_lag_and_ipc(server_process: ServerProcess, tmp_path: Path) -> None:
    """`asr-loadgen capacity` against a real multi-process server: a few live calls of line noise (no
    engine work) and of speech (engine work over the IPC), a few seconds each. The report's fields must
    be there and sane; the figures themselves are scripts/bench_capacity.py's business."""
    telephone = build_manifest(tmp_path / "speech", count=2, encodings=("MULAW",))
    server = server_process  # one frontend: the report names its processes
    common = [
        "capacity",
        "--server",
        server.target,
        "--metrics",
        server.metrics_url,
        "--connections",
        "2",
    ]
    assert (
        loadgen.main([*common, "--calls", "4", "--seconds", "2", "--json-out", str(tmp_path / "n.json")]) == 0
    )
    noise = json.loads((tmp_path / "n.json").read_text())
    assert noise["ok"] == 4 and noise["errors"] == {}
    assert noise["finals"] == 0 and noise["ipc_utterances"] == 0  # hiss: nothing reached the engine
    assert 0 <= noise["close_lag_p50_s"] <= noise["close_lag_p95_s"] <= noise["close_lag_max_s"] < 30
    assert isinstance(noise["kept_up"], bool)
    by_process = noise["server_cpu_s_by_process"]
    assert set(by_process) == {"supervisor", "engine", "frontend-0"}, by_process
    assert by_process["frontend-0"] > 0  # the frontend decoded and endpointed the audio
    assert noise["server_cpu_s"] == pytest.approx(sum(by_process.values()))
    # CPU seconds per second of call audio, in % of a core: above 0, below all cores for 4 calls
    assert 0 < noise["cpu_per_call_pct"] < 100 * (os.cpu_count() or 1) / 4 * 2
    assert 2.0 <= noise["wall_s"] < 30

    argv = [*common, "--calls", "2", "--seconds", "8", "--chunk-ms", "100", "--manifest", str(telephone)]
    assert loadgen.main([*argv, "--json-out", str(tmp_path / "s.json")]) == 0
    speech = json.loads((tmp_path / "s.json").read_text())
    assert speech["ok"] == 2 and speech["finals"] >= 2  # each call spoke at least one sentence
    assert speech["ipc_utterances"] >= 2 and 0 < speech["ipc_mean_s"] < 5
    assert speech["server_cpu_s_by_process"]["engine"] > 0  # the engine transcribed them
