"""`asr-client`: stream a recording to the server (or Recognize it whole) and print results as they come.

    asr-client call.wav --server 127.0.0.1:50051 --realtime --interim
    asr-client call.ulaw --separate-channels --json-out results.jsonl
    asr-client jfk.flac --recognize
    asr-client recordings/ --out transcripts/ --concurrency 8 --separate-channels

WAV/FLAC go as LINEAR16 at their own rate; .ulaw/.alaw (or --encoding MULAW|ALAW) as G.711 at 8 kHz.
On a terminal interim hypotheses overwrite one line; otherwise every result is its own line.
A folder is transcribed in bulk (clients/bulk.py): JSON and SRT per recording into --out, with a
progress bar; a rerun skips recordings already done from the same content with the same options.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from asr.v1 import asr_pb2
from google.protobuf.json_format import MessageToDict
from grpc import aio

from clients.bulk import DEFAULT_MAX_RECOGNIZE_BYTES, DEFAULT_RETRIES, BulkOptions, transcribe_folder
from clients.client import G711_RATE, RecognizerClient, Tls, redactions

EventType = asr_pb2.StreamingRecognizeResponse.SpeechEventType


def _s(d: Any) -> float:
    return round(d.seconds + d.nanos / 1e9, 3)


def _clock(seconds: float) -> str:
    m, s = divmod(seconds, 60)
    return f"{int(m):02d}:{s:05.2f}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asr-client", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "file",
        help="WAV/FLAC (sent as LINEAR16), .ulaw/.alaw (G.711 8 kHz), or raw PCM with --rate; "
        "or a folder of them (bulk, with --out)",
    )
    p.add_argument("--server", default="127.0.0.1:50051", help="host:port (default: %(default)s)")
    p.add_argument("--realtime", action="store_true", help="send audio at its own pace, like a live call")
    p.add_argument(
        "--chunk-ms", type=float, default=20, help="audio per request in ms (default: %(default)s)"
    )
    p.add_argument("--interim", action="store_true", help="ask for interim (partial) results")
    p.add_argument("--separate-channels", action="store_true", help="recognize each channel on its own")
    p.add_argument(
        "--encoding",
        default="auto",
        type=str.upper,
        choices=["AUTO", "LINEAR16", "MULAW", "ALAW"],
        help="auto: from the file (default)",
    )
    p.add_argument("--rate", type=int, help=f"sample rate of raw audio (default: {G711_RATE} for G.711)")
    p.add_argument("--channels", type=int, help="channels of raw audio (default: 1)")
    p.add_argument("--prompt", help="hint text: names, products, jargon")
    p.add_argument(
        "--keyterms",
        type=_keyterms,
        default=(),
        help="comma-separated names and jargon to recognise more readily (RecognitionConfig.keyterms)",
    )
    p.add_argument(
        "--formatting",
        choices=("verbatim", "smart"),
        default="verbatim",
        help="smart: spoken numbers, amounts and dates as digits in finals (default: %(default)s)",
    )
    p.add_argument("--language", help='BCP-47 ("en-US") or Whisper ("en") language code')
    p.add_argument("--single-utterance", action="store_true", help="stop after the first utterance")
    p.add_argument("--segments", action="store_true", help="ask for segment time offsets")
    p.add_argument("--recognize", action="store_true", help="send the whole file in one Recognize call")
    p.add_argument(
        "--redact",
        type=_redactions,
        default=[],
        metavar="pci,ssn,numbers",
        help="have the server mask card numbers (pci), social security numbers (ssn) and every other "
        "number (numbers) in everything it sends back, for a file or a folder (docs/operations.md)",
    )
    p.add_argument("--json-out", help="also write every result as a JSON line to this file")
    p.add_argument(
        "--token",
        default=os.environ.get("ASR_TOKEN"),
        help="bearer token for the server (default: $ASR_TOKEN, which unlike a flag does not show in ps)",
    )
    p.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --ca-cert)")
    p.add_argument("--ca-cert", help="CA certificate (PEM) that signed the server's certificate")
    p.add_argument("--client-cert", help="client certificate (PEM) for mutual TLS (with --client-key)")
    p.add_argument("--client-key", help="client private key (PEM) for mutual TLS")
    p.add_argument("--timeout", type=float, default=None, help="deadline for the whole call in seconds")
    bulk = p.add_argument_group("bulk (FILE is a folder)")
    bulk.add_argument("--out", help="folder for <recording>.json and <recording>.srt (required for a folder)")
    bulk.add_argument(
        "--concurrency",
        type=_positive_int,
        default=4,
        help="recordings in flight at once (default: %(default)s)",
    )
    bulk.add_argument(
        "--max-recognize-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_RECOGNIZE_BYTES,
        help="the server's --max-recognize-bytes: larger files are streamed instead (default: %(default)s)",
    )
    bulk.add_argument(
        "--stream-speed",
        type=float,
        default=2.0,
        help="files streamed instead: send at this many times real time, 0 = as fast as the server reads "
        "(keep it below what the server transcribes, or it refuses past --max-buffer-seconds; default: %(default)s)",
    )
    bulk.add_argument(
        "--retries",
        type=_non_negative_int,
        default=DEFAULT_RETRIES,
        help="attempts at a recording that make no progress (the server draining, restarting or full), "
        "each after a backoff of 1, 2, 4, ... s (at most 10), before it fails and a rerun redoes it; a "
        "stream the server drains is continued from where it stopped (default: %(default)s)",
    )
    bulk.add_argument(
        "--channel-names",
        default="agent,customer",
        help="with --separate-channels: names of channels 1, 2, ... in the outputs (default: %(default)s)",
    )
    return p


def _redactions(text: str) -> list[int]:
    try:
        return redactions(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _keyterms(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _formatting(name: str) -> int:
    return asr_pb2.Formatting.Value(name.upper())


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class Printer:
    """Results to the terminal (and JSON lines to a file)."""

    def __init__(self, out: IO[str], json_out: IO[str] | None) -> None:
        self.out = out
        self.json_out = json_out
        self.tty = out.isatty()
        self._partial = False  # an interim line is showing and will be overwritten

    def _line(self, text: str) -> None:
        if self._partial:
            self.out.write("\r\033[K")
            self._partial = False
        self.out.write(text + "\n")
        self.out.flush()

    def _json(self, record: dict[str, Any]) -> None:
        if self.json_out is not None:
            self.json_out.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.json_out.flush()

    def stream_response(self, r: asr_pb2.StreamingRecognizeResponse) -> None:
        if r.speech_event_type:
            name = EventType.Name(r.speech_event_type)
            self._json(
                {
                    "type": "event",
                    "event": name,
                    "offset_s": _s(r.speech_event_offset),
                    "channel": r.speech_event_channel_tag,
                }
            )
            if r.speech_event_type in (EventType.END_OF_SINGLE_UTTERANCE, EventType.RECONNECT):
                self._line(f"# {name}")
        if r.HasField("call_metrics"):
            self.call_metrics(r.call_metrics)
        for res in r.results:
            self.result(
                "final" if res.is_final else "interim",
                res.alternatives[0] if res.alternatives else asr_pb2.SpeechRecognitionAlternative(),
                _s(res.start_offset),
                _s(res.end_offset),
                res.channel_tag,
                extra={
                    "stability": round(res.stability, 3),
                    "utterance_index": res.utterance_index,
                    "language": res.language_code,
                },
            )

    def call_metrics(self, m: asr_pb2.CallMetrics) -> None:
        """The call's metrics: one line, and a JSON line with every field."""
        self._json({"type": "call_metrics", **MessageToDict(m, preserving_proto_field_name=True)})
        parts = [
            f"{_s(m.total_time):.1f} s",
            f"non-talk {_s(m.non_talk_time):.1f} s",
            f"overlap {_s(m.overlap_time):.1f} s",
        ]
        for c in m.channels:
            loudness = f", {c.mean_loudness_dbfs:.1f} dBFS" if c.HasField("mean_loudness_dbfs") else ""
            parts.append(
                f"ch{c.channel_tag} talk {_s(c.talk_time):.1f} s, {c.words_per_minute:.0f} wpm{loudness}, "
                f"{c.interruptions} interruptions"
            )
        self._line("# call metrics: " + "; ".join(parts))

    def result(
        self,
        kind: str,
        alt: asr_pb2.SpeechRecognitionAlternative,
        start: float,
        end: float,
        channel: int,
        extra: dict[str, Any] | None = None,
    ) -> None:
        where = f"[{_clock(start)}-{_clock(end)}{f' ch{channel}' if channel else ''}]"
        record = {
            "type": kind,
            "transcript": alt.transcript,
            "start_s": start,
            "end_s": end,
            "channel": channel,
            "confidence": round(alt.confidence, 3),
            **(extra or {}),
        }
        if alt.segments:
            record["segments"] = [
                {"text": s.text, "start_s": _s(s.start_offset), "end_s": _s(s.end_offset)}
                for s in alt.segments
            ]
        self._json(record)
        if kind == "final":
            self._line(f"{where} {alt.transcript}")
        elif self.tty:
            self.out.write(f"\r\033[K… {where} {alt.transcript}")
            self.out.flush()
            self._partial = True
        else:
            self._line(f"… {where} {alt.transcript}")


async def run(args: argparse.Namespace, printer: Printer) -> None:
    use_tls = args.tls or args.ca_cert or args.client_cert
    tls = Tls(args.ca_cert, args.client_cert, args.client_key) if use_tls else None
    async with RecognizerClient(args.server, token=args.token, tls=tls) as client:
        if args.bulk:
            outcomes = await transcribe_folder(client, Path(args.file), bulk_options(args))
            if any(o.status == "failed" for o in outcomes):
                raise BulkFailed(sum(o.status == "failed" for o in outcomes))
            return
        # what a recording and a stream of it are both asked with
        asked: dict[str, Any] = {
            "encoding": args.encoding,
            "rate": args.rate,
            "channels": args.channels,
            "separate_channels": args.separate_channels,
            "prompt": args.prompt,
            "language": args.language,
            "segment_offsets": args.segments,
            "deadline_s": args.timeout,
            "redact": args.redact,
            "keyterms": args.keyterms,
            "formatting": _formatting(args.formatting),
        }
        if args.recognize:
            response = await client.recognize_file(args.file, **asked)
            for res in response.results:
                printer.result(
                    "final", res.alternatives[0], _s(res.start_offset), _s(res.end_offset), res.channel_tag
                )
            if response.HasField("call_metrics"):
                printer.call_metrics(response.call_metrics)
            return
        async for response in client.stream_file(
            args.file,
            chunk_ms=args.chunk_ms,
            realtime=args.realtime,
            interim=args.interim,
            single_utterance=args.single_utterance,
            **asked,
        ):
            printer.stream_response(response)


class BulkFailed(Exception):
    """Some recordings of a folder failed (each was reported as it failed)."""


def bulk_options(args: argparse.Namespace) -> BulkOptions:
    if not args.out:
        raise ValueError(f"{args.file} is a folder: give --out FOLDER for the transcripts")
    return BulkOptions(
        out_dir=Path(args.out),
        concurrency=args.concurrency,
        encoding=args.encoding,
        rate=args.rate,
        channels=args.channels,
        separate_channels=args.separate_channels,
        channel_names=[n.strip() for n in args.channel_names.split(",")],
        language=args.language,
        prompt=args.prompt,
        redact=args.redact,
        max_recognize_bytes=args.max_recognize_bytes,
        stream_speed=args.stream_speed,
        timeout_s=args.timeout,
        retries=args.retries,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.bulk = os.path.isdir(args.file)
    json_out = open(args.json_out, "w", encoding="utf-8") if args.json_out else None  # noqa: SIM115
    try:
        asyncio.run(run(args, Printer(sys.stdout, json_out)))
    except aio.AioRpcError as e:
        sys.exit(f"asr-client: {e.code().name}: {e.details()}")
    except BulkFailed as e:
        sys.exit(f"asr-client: {e.args[0]} recording(s) failed (listed above)")
    except (OSError, ValueError) as e:
        sys.exit(f"asr-client: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        if json_out is not None:
            json_out.close()


if __name__ == "__main__":
    main()
