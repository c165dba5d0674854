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
                "on",
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
        False, 8, "trim", True, 25.0
    )  # fmt: skip
    assert parse_args([]) == ServerConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--encoder-batching", "maybe"], "on or off"),
        (["--encoder-context", "half"], "invalid choice"),
        (["--max-streams", "0"], "--max-streams must be at least 1"),
        (["--drain-seconds", "-1"], "--drain-seconds"),
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
