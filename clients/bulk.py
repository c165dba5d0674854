"""Bulk transcription: every recording under a folder -> `<out>/<path>.json` and `<out>/<path>.srt`.

    asr-client recordings/ --out transcripts/ --concurrency 8 --separate-channels

Each file goes in one Recognize call; a file larger than --max-recognize-bytes (the server's limit) is
streamed instead, at --stream-speed times real time. Outputs are written to a temporary name and
renamed, so a file's outputs are either complete or absent: a rerun skips files whose two outputs
exist, and redoes the rest. A file that fails is reported (and leaves no output) without stopping
the others; the exit status is 1 if any failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from asr.v1 import asr_pb2
from google.protobuf.json_format import MessageToDict
from grpc import aio
from tqdm import tqdm

from clients.client import (
    _G711_SUFFIXES,
    _RAW_PCM_SUFFIXES,
    RecognizerClient,
    chunks_of,
    load_audio,
    paced,
)
from service.subtitles import Cue, srt

FILE_SUFFIXES = {".wav", ".flac"}
DEFAULT_MAX_RECOGNIZE_BYTES = 64 << 20  # the server's default --max-recognize-bytes


@dataclass(frozen=True)
class BulkOptions:
    out_dir: Path
    concurrency: int = 4
    encoding: str = "auto"
    rate: int | None = None
    channels: int | None = None
    separate_channels: bool = False
    channel_names: Sequence[str] = ("agent", "customer")
    language: str | None = None
    prompt: str | None = None
    max_recognize_bytes: int = DEFAULT_MAX_RECOGNIZE_BYTES
    stream_speed: float = 2.0
    timeout_s: float | None = None


@dataclass(frozen=True)
class Outcome:
    path: Path
    status: str  # "done", "skipped", "failed"
    error: str = ""


def find_recordings(folder: Path, encoding: str = "auto") -> list[Path]:
    """WAV, FLAC and G.711 (.ulaw, .alaw, ...) files under `folder`; raw PCM too with an explicit encoding."""
    suffixes = FILE_SUFFIXES | set(_G711_SUFFIXES)
    if encoding.upper() != "AUTO":
        suffixes |= _RAW_PCM_SUFFIXES
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)


def outputs_for(path: Path, folder: Path, out_dir: Path) -> tuple[Path, Path]:
    """`a/b.wav` -> (`<out>/a/b.wav.json`, `<out>/a/b.wav.srt`): the full name, so b.wav and b.flac differ."""
    rel = path.relative_to(folder)
    base = out_dir / rel.parent / rel.name
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".srt")


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename it over: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _s(d: Any) -> float:
    return round(d.seconds + d.nanos / 1e9, 3)


def speaker(tag: int, names: Sequence[str]) -> str:
    """channel_tag (1-based when channels are recognized separately, else 0) -> a name, "" for mono."""
    if tag <= 0:
        return ""
    return names[tag - 1] if tag <= len(names) else f"ch{tag}"


def to_json(
    response: asr_pb2.RecognizeResponse, source: str, method: str, names: Sequence[str]
) -> dict[str, Any]:
    """The response as JSON (every proto field, so fields added later appear too) plus the whole text
    and a speaker name per result."""
    body = MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for result, r in zip(body.get("results", []), response.results, strict=True):
        if r.channel_tag:
            result["speaker"] = speaker(r.channel_tag, names)
    text = " ".join(r.alternatives[0].transcript for r in response.results if r.alternatives)
    return {"file": source, "method": method, "text": text, **body}


def to_srt(response: asr_pb2.RecognizeResponse, names: Sequence[str]) -> str:
    """One cue per Whisper segment (per utterance when there are none), the speaker in front on stereo."""
    cues: list[Cue] = []
    for r in response.results:
        alt = r.alternatives[0]
        who = speaker(r.channel_tag, names)
        prefix = f"[{who}] " if who else ""
        parts = [(s.text, s.start_offset, s.end_offset) for s in alt.segments if s.text] or [
            (alt.transcript, r.start_offset, r.end_offset)
        ]
        cues.extend(Cue(_s(start), _s(end), prefix + text) for text, start, end in parts)
    cues.sort(key=lambda c: c.start_s)
    return srt(cues)


async def stream_whole(client: RecognizerClient, path: Path, opts: BulkOptions) -> asr_pb2.RecognizeResponse:
    """A file too big for one Recognize: streamed (paced at `stream_speed` x real time; 0 = unpaced),
    its finals gathered into the RecognizeResponse that Recognize would have given."""
    audio = load_audio(path, opts.encoding, opts.rate, opts.channels)
    config = asr_pb2.StreamingRecognitionConfig(
        config=asr_pb2.RecognitionConfig(
            encoding=audio.encoding,  # type: ignore[arg-type]
            sample_rate_hertz=audio.sample_rate_hertz,
            audio_channel_count=audio.channels,
            enable_separate_recognition_per_channel=opts.separate_channels,
            language_code=opts.language or "",
            prompt=opts.prompt or "",
            enable_segment_time_offsets=True,
        )
    )
    chunk_ms = 100.0
    pace = opts.stream_speed > 0
    chunks = paced(chunks_of(audio, chunk_ms), chunk_ms / 1000 / (opts.stream_speed or 1), pace)
    response = asr_pb2.RecognizeResponse()
    async with aclosing(client.stream(config, chunks, deadline_s=opts.timeout_s)) as responses:
        async for r in responses:
            for res in r.results:
                if res.is_final and res.alternatives and res.alternatives[0].transcript:
                    response.results.append(
                        asr_pb2.SpeechRecognitionResult(
                            alternatives=res.alternatives,
                            channel_tag=res.channel_tag,
                            start_offset=res.start_offset,
                            end_offset=res.end_offset,
                            language_code=res.language_code,
                        )
                    )
    response.total_audio_duration.FromNanoseconds(round(audio.duration_s * 1e9))
    response.results.sort(key=lambda r: (r.start_offset.ToNanoseconds(), r.channel_tag))
    return response


def _done_and_size(path: Path, json_path: Path, srt_path: Path) -> tuple[bool, int]:
    """(both outputs exist, the recording's size); outputs are written atomically, so existing means complete."""
    done = json_path.exists() and srt_path.exists()
    return done, (0 if done else path.stat().st_size)


async def transcribe_file(client: RecognizerClient, path: Path, folder: Path, opts: BulkOptions) -> Outcome:
    json_path, srt_path = outputs_for(path, folder, opts.out_dir)
    done, size = await asyncio.to_thread(_done_and_size, path, json_path, srt_path)
    if done:
        return Outcome(path, "skipped")
    try:
        if size <= opts.max_recognize_bytes:
            method = "recognize"
            response = await client.recognize_file(
                path,
                encoding=opts.encoding,
                rate=opts.rate,
                channels=opts.channels,
                separate_channels=opts.separate_channels,
                prompt=opts.prompt,
                language=opts.language,
                segment_offsets=True,
                deadline_s=opts.timeout_s,
            )
        else:
            method = "stream"
            response = await stream_whole(client, path, opts)
    except aio.AioRpcError as e:
        return Outcome(path, "failed", f"{e.code().name}: {e.details()}")
    except (
        OSError,
        ValueError,
        RuntimeError,
    ) as e:  # unreadable or undecodable here (soundfile: RuntimeError)
        return Outcome(path, "failed", f"{type(e).__name__}: {e}")
    source = str(path.relative_to(folder))
    write_atomic(
        json_path, json.dumps(to_json(response, source, method, opts.channel_names), indent=2) + "\n"
    )
    write_atomic(srt_path, to_srt(response, opts.channel_names))
    return Outcome(path, "done")


async def transcribe_folder(
    client: RecognizerClient, folder: Path, opts: BulkOptions, err: IO[str] = sys.stderr
) -> list[Outcome]:
    """Every recording under `folder`, at most `opts.concurrency` at a time, with a progress bar on `err`
    (shown on a terminal only); a failure is reported at once and the others go on."""
    files = find_recordings(folder, opts.encoding)
    if not files:
        raise ValueError(f"{folder}: no recordings (.wav, .flac, .ulaw, .alaw) found")
    gate = asyncio.Semaphore(opts.concurrency)
    outcomes: list[Outcome] = []
    with tqdm(total=len(files), unit="file", file=err, disable=None, dynamic_ncols=True) as bar:

        async def one(path: Path) -> None:
            async with gate:
                outcome = await transcribe_file(client, path, folder, opts)
            outcomes.append(outcome)
            if outcome.status == "failed":
                tqdm.write(f"failed: {path.relative_to(folder)}: {outcome.error}", file=err)
            bar.set_postfix(failed=sum(o.status == "failed" for o in outcomes), refresh=False)
            bar.update(1)

        await asyncio.gather(*(one(p) for p in files))
    counts = {s: sum(o.status == s for o in outcomes) for s in ("done", "skipped", "failed")}
    err.write(
        f"{len(files)} recordings: {counts['done']} transcribed, {counts['skipped']} skipped (already done), "
        f"{counts['failed']} failed -> {opts.out_dir}\n"
    )
    err.flush()
    return sorted(outcomes, key=lambda o: o.path)
