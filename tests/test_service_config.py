"""asr-server's flags: every setting of ServerConfig and EngineConfig is a flag, shown in --help."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from service.config import ServerConfig, parse_args
from tests.support.server import HOST, free_port


def _flags() -> list[str]:
    fields = [f for f in dataclasses.fields(ServerConfig) if f.name != "engine"]
    fields += dataclasses.fields(EngineConfig)
    return ["--" + f.name.replace("_", "-") for f in fields if not f.metadata.get("hidden")]  # test seams


def test_every_setting_is_a_flag_in_asr_server_help() -> None:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("asr-server")), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    missing = [flag for flag in _flags() if flag not in out]
    assert not missing
    assert "(default: 50051)" in out and "(default: on)" in out  # defaults shown


def test_flags_parse_into_typed_config() -> None:
    c = parse_args(
        [
            *("--port", "6000", "--encoder-batching", "off", "--kv-slots", "8", "--encoder-context", "trim"),
            *(
                "--quantize",
                "int8-per-tensor",
                "--batch-window-ms",
                "25",
                "--log-transcripts",
                "on",
                "--log-format",
                "text",
            ),
        ]
    )
    assert (c.port, c.log_transcripts, c.log_format) == (6000, True, "text")
    e = c.engine
    assert (e.encoder_batching, e.kv_slots, e.encoder_context, e.quantize, e.batch_window_ms) == (
        False, 8, "trim", "int8-per-tensor", 25.0
    )  # fmt: skip
    assert parse_args([]) == ServerConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--encoder-batching", "maybe"], "on or off"),
        (["--encoder-context", "half"], "invalid choice"),
        (["--max-streams", "0"], "--max-streams must be at least 1"),
        (["--drain-seconds", "-1"], "--drain-seconds"),
        (["--engine-heartbeat-timeout", "0.5"], "--engine-heartbeat-timeout must be 0 (off) or 1-3600 s"),
        (["--idle-audio-timeout", "-1"], "--idle-audio-timeout must be 0 (off) or positive"),
        (["--vad-gate-db", "25"], "--vad-gate-db must be 0 (off) to 20 dB"),
        (["--vad-gate-db", "-1"], "--vad-gate-db must be 0 (off) to 20 dB"),
        (["--context-carry-tokens", "224"], "--context-carry-tokens must be 0 (off) to 223"),
        (["--keepalive-time", "0.5"], "--keepalive-time must be at least 1 s"),
        (["--keepalive-timeout", "0"], "--keepalive-timeout must be at least 1 s"),
        (["--max-connection-age", "0.5"], "--max-connection-age must be 0 (off) or at least 1 s"),
        (["--max-concurrent-rpcs", "-1"], "--max-concurrent-rpcs must be 0 (from --max-streams) or positive"),
        (["--beam-size-final", "6"], "--beam-size-final must be 1-5 (--max-beam-size 5)"),
        (["--beam-size-recorded", "3", "--kv-slots", "2"], "--beam-size-recorded must be 1-2 (--kv-slots 2)"),
        (["--beam-size-final", "0"], "--beam-size-final must be 1-5"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert message in (str(e.value.code) + capsys.readouterr().err)


def test_model_that_cannot_load_exits_non_zero_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [
            *(str(Path(sys.executable).with_name("asr-server")), "--host", HOST, "--port", str(free_port())),
            *("--metrics-port", "0", "--model", str(missing), "--log-format", "text"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"could not load model '{missing}'" in proc.stderr


# Every engine setting with a numeric range, one value just outside it, and the range the message names.
ENGINE_OUT_OF_RANGE = [
    ("--max-batch", "0", "--max-batch must be 1-1024"),
    ("--kv-slots", "0", "--kv-slots must be 1-4096"),
    ("--max-beam-size", "0", "--max-beam-size must be 1-64"),
    ("--best-of", "0", "--best-of must be 1-20"),
    ("--temperatures", "0,1.5", "--temperatures[1] must be a number from 0 to 1"),
    ("--max-queue", "0", "--max-queue must be 1-1000000"),
    ("--max-queue", "-5", "--max-queue must be 1-1000000"),
    ("--max-queue-recorded", "0", "--max-queue-recorded must be 1-1000000"),
    ("--max-recorded-rows", "-1", "--max-recorded-rows must be 0-4096"),
    ("--recorded-encoder-budget-ms", "-1", "--recorded-encoder-budget-ms must be 0-60000 ms"),
    ("--trim-margin-s", "0", "--trim-margin-s must be 0.0125-30.0 s"),
    ("--trim-margin-s", "0.0124", "--trim-margin-s must be 0.0125-30.0 s"),
    ("--trim-floor-s", "31", "--trim-floor-s must be 0-30.0 s"),
    ("--batch-window-ms", "-1", "--batch-window-ms must be 0-60000 ms"),
    ("--max-tokens", "0", "--max-tokens must be 7-448"),
    ("--max-tokens", "449", "--max-tokens must be 7-448"),
    ("--threads", "-1", "--threads must be 0-1024"),
    ("--max-encoder-batch-while-decoding", "-1", "--max-encoder-batch-while-decoding must be 0-1024"),
    ("--encoder-budget-while-decoding-ms", "-1", "--encoder-budget-while-decoding-ms must be 0-60000 ms"),
    ("--dtype", "float8", "--dtype must be one of auto, float32, float16, bfloat16"),
    ("--debug-crash-scheduler-after", "-1", "--debug-crash-scheduler-after must be 0-1000000"),
    ("--debug-hang-scheduler-after", "-1", "--debug-hang-scheduler-after must be 0-1000000"),
    ("--debug-drop-replies", "-1", "--debug-drop-replies must be 0-1000000"),
    ("--debug-slow-encoder-s", "-1", "--debug-slow-encoder-s must be 0-600 s"),
    ("--keyterm-bonus", "31", "--keyterm-bonus must be 0-30"),
    ("--keyterm-max-gap", "-1", "--keyterm-max-gap must be 0-100"),
    ("--keyterm-beam-bonus", "101", "--keyterm-beam-bonus must be 0-100"),
    ("--keyterm-respell-margin", "-1", "--keyterm-respell-margin must be 0-100"),
    ("--keyterm-cache-bytes", "-1", "--keyterm-cache-bytes must be 0-1099511627776 bytes"),
]


@pytest.mark.parametrize(("flag", "value", "message"), ENGINE_OUT_OF_RANGE)
def test_engine_flag_out_of_range_exits_2_naming_flag_and_range(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args([flag, value])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_every_numeric_engine_setting_has_a_range() -> None:
    from engine.config import FLAGS_WITH_RANGES

    flags = {f for f, _, _ in ENGINE_OUT_OF_RANGE}
    assert {"--" + n.replace("_", "-") for n in FLAGS_WITH_RANGES} <= flags | {"--batch-window-ms"}
    for name in FLAGS_WITH_RANGES:  # a far-out value of each is refused naming its flag
        config = EngineConfig(**{name: -(10**9)})  # type: ignore[arg-type]
        assert any(p.startswith("--" + name.replace("_", "-") + " must be") for p in config.validate())


def test_defaults_and_the_range_edges_are_accepted() -> None:
    assert EngineConfig().validate() == []
    edges = parse_args(
        ["--max-batch", "1", "--kv-slots", "1", "--max-queue", "1", "--trim-margin-s", "0.0125"]
    )
    assert (edges.engine.max_batch, edges.engine.trim_margin_s) == (1, 0.0125)
    assert (
        parse_args(["--batch-window-ms", "0", "--max-tokens", "448", "--threads", "0"]).engine.max_tokens
        == 448
    )


@pytest.mark.parametrize(("flag", "value", "message"), [ENGINE_OUT_OF_RANGE[0], ENGINE_OUT_OF_RANGE[5]])
def test_asr_server_refuses_an_engine_flag_out_of_range_before_opening_any_port(
    flag: str, value: str, message: str
) -> None:
    port, metrics_port = free_port(), free_port()
    proc = subprocess.run(
        [
            *(str(Path(sys.executable).with_name("asr-server")), "--host", HOST, "--port", str(port)),
            *("--metrics-port", str(metrics_port), flag, value),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "metrics at" not in proc.stderr and "listening" not in proc.stderr.lower()
