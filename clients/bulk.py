"""Bulk transcription: every recording under a folder -> `<out>/<path>.json` and `<out>/<path>.srt`.

    asr-client recordings/ --out transcripts/ --concurrency 8 --separate-channels --redact pci

Each file goes in one Recognize call; a file larger than --max-recognize-bytes (the server's limit) is
streamed instead, at --stream-speed times real time.

What a rerun can trust:
- Complete or absent. A file's outputs are written only once its whole audio is transcribed: a stream
  the server drains mid-file (RECONNECT, every rollout) is continued on a new stream from the offset the
  server says it heard (from the start of an utterance the drain cut short, whose final is dropped; after
  a failed stream, from the end of the last final), its offsets shifted to the file's time; a Recognize
  cut by a drain (UNAVAILABLE, ...) is sent again. Attempts that make no progress are
  retried --retries times with backoff (1, 2, 4, ... s, at most 10), then the file fails, leaves no output,
  and a rerun redoes it.
- Made from what. The JSON records the input's fingerprint (size, mtime, SHA-256 of the content) and the
  options that shape a transcript (encoding, rate, channels, channel separation and names, language,
  prompt, redaction), and the SHA-256 of the SRT written with it. A rerun skips a file only when its JSON
  says complete, was made from the same content with the same options, and the SRT is the one it names;
  anything else (a changed input or option, an output of an older client, one output missing or edited)
  is done again.
- One file's trouble is that file's. A failed transcription or a failed write (a name too long for the
  file system, a full disk) fails that file (reported at once as `failed: NAME: ...`) and the others go on;
  the exit status is 1 if any failed.
- Private and in place. Outputs are created 0600 (folders 0700) under --out, written to a temporary name
  and renamed, and never through a symbolic link: a folder or output below --out that is a link is
  refused (the file fails), so a link planted in the output tree cannot redirect a transcript.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import secrets
import stat
import sys
from collections.abc import Iterator, Sequence
from contextlib import aclosing, contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import grpc
from asr.subtitles import Cue, srt
from asr.v1 import asr_pb2
from google.protobuf.json_format import MessageToDict
from grpc import aio
from tqdm import tqdm

from clients.client import (
    _G711_SUFFIXES,
    _RAW_PCM_SUFFIXES,
    Audio,
    RecognizerClient,
    chunks_of,
    load_audio,
    paced,
)

FILE_SUFFIXES = {".wav", ".flac"}
DEFAULT_MAX_RECOGNIZE_BYTES = 64 << 20  # the server's default --max-recognize-bytes
DEFAULT_RETRIES = 5
OUTPUT_FORMAT = 2  # 2: outputs record what they were made from; older ones are redone
# A drain, a restart, a full engine or a server cancelling at shutdown: worth another attempt.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}
# A stream also ends INTERNAL ("Internal error from Core") when the server ends it while this side's
# write is in flight (grpc/grpc#36066: a drain's RECONNECT races the next chunk); its finals still
# stand, and the next stream goes on after them.
STREAM_RETRYABLE = RETRYABLE | {grpc.StatusCode.INTERNAL}
_HASH_BLOCK = 1 << 20


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
    redact: Sequence[int] = ()  # asr_pb2.Redaction values
    max_recognize_bytes: int = DEFAULT_MAX_RECOGNIZE_BYTES
    stream_speed: float = 2.0
    timeout_s: float | None = None
    retries: int = DEFAULT_RETRIES

    def shaping(self) -> dict[str, Any]:
        """The options that change what a transcript says (recorded in each output; a change redoes it)."""
        return {
            "encoding": self.encoding.upper(),
            "rate": self.rate,
            "channels": self.channels,
            "separate_channels": self.separate_channels,
            "channel_names": list(self.channel_names),
            "language": self.language or "",
            "prompt": self.prompt or "",
            "redact": sorted(asr_pb2.Redaction.Name(v) for v in self.redact),  # type: ignore[arg-type]
        }


@dataclass(frozen=True)
class Outcome:
    path: Path
    status: str  # "done", "skipped", "failed"
    error: str = ""


@dataclass(frozen=True)
class Fingerprint:
    """What an output was made from: the input as it was read."""

    size: int
    mtime_ns: int
    sha256: str


def fingerprint(path: Path) -> Fingerprint:
    st = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            digest.update(block)
    return Fingerprint(st.st_size, st.st_mtime_ns, digest.hexdigest())


class Incomplete(Exception):
    """The server stopped hearing the file before its end, and continuing it failed --retries times."""


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


# --- outputs: 0600, atomic, never through a symbolic link ------------------------------------------


class OutputError(OSError):
    """An output could not be written or read safely; `filename` is its path under the output folder."""


@contextmanager
def _folder(out_dir: Path, rel_parent: Path, *, create: bool) -> Iterator[int]:
    """A descriptor of `out_dir/rel_parent`, each folder below out_dir opened without following a link
    (O_NOFOLLOW), created 0700 when missing and `create`."""
    if create:
        out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    walked = Path()
    try:
        for name in rel_parent.parts:
            walked /= name
            if create:
                with suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OutputError(e.errno, "not a folder (a symbolic link?): refused", str(walked)) from e
                raise OutputError(e.errno, e.strerror or str(e), str(walked)) from e
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _refuse_link(name: str, dir_fd: int) -> None:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "a symbolic link: refused", name)


def write_outputs(out_dir: Path, rel_parent: Path, files: Sequence[tuple[str, bytes]]) -> None:
    """Write each (name, content) under out_dir/rel_parent: a 0600 temporary file, fsync, rename over
    the name (files in the order given: the last is the commit record), then fsync the folder."""
    with _folder(out_dir, rel_parent, create=True) as fd:
        for name, content in files:
            try:
                _write_one(fd, name, content)
            except OSError as e:
                raise OutputError(e.errno, e.strerror or str(e), str(rel_parent / name)) from e
        os.fsync(fd)


def _write_one(fd: int, name: str, content: bytes) -> None:
    _refuse_link(name, fd)
    tmp = f".asr-{secrets.token_hex(6)}.tmp"  # short: only the real name can be too long
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
    try:
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(out, view) :]
            os.fsync(out)
        finally:
            os.close(out)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
        raise


def remove_outputs(out_dir: Path, rel_parent: Path, names: Sequence[str]) -> None:
    """Best effort: what a failed file leaves under its names is removed (a link itself, not its target)."""
    try:
        with _folder(out_dir, rel_parent, create=False) as fd:
            for name in names:
                with suppress(OSError):
                    os.unlink(name, dir_fd=fd)
    except OSError:
        pass


def read_output(out_dir: Path, rel_parent: Path, name: str) -> bytes | None:
    """An output's bytes, or None when it is missing or not a regular file reached without a link."""
    try:
        with _folder(out_dir, rel_parent, create=False) as fd:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                if not stat.S_ISREG(os.fstat(f).st_mode):
                    return None
                with os.fdopen(f, "rb", closefd=False) as stream:
                    return stream.read()
            finally:
                os.close(f)
    except OSError:
        return None


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


def record(
    response: asr_pb2.RecognizeResponse,
    source: str,
    method: str,
    made_from: Fingerprint,
    opts: BulkOptions,
    srt_text: str,
    resumed_at_s: Sequence[float] = (),
) -> dict[str, Any]:
    """The JSON output: the transcript and what it was made from (what a rerun checks)."""
    return {
        "format": OUTPUT_FORMAT,
        "complete": True,
        "made_from": {**asdict(made_from), "options": opts.shaping()},
        "srt_sha256": hashlib.sha256(srt_text.encode()).hexdigest(),
        **({"resumed_at_s": [round(t, 3) for t in resumed_at_s]} if method == "stream" else {}),
        **to_json(response, source, method, opts.channel_names),
    }


def is_done(existing: bytes | None, srt_bytes: bytes | None, path: Path, opts: BulkOptions) -> bool:
    """True when the outputs are complete, were made from this very content with these options, and the
    SRT is the one written with the JSON."""
    if existing is None or srt_bytes is None:
        return False
    try:
        old = json.loads(existing)
        made_from = old["made_from"]
        if old.get("format") != OUTPUT_FORMAT or old.get("complete") is not True:
            return False
        if made_from.get("options") != opts.shaping() or made_from.get("size") != path.stat().st_size:
            return False
        if old.get("srt_sha256") != hashlib.sha256(srt_bytes).hexdigest():
            return False
    except (ValueError, TypeError, KeyError, AttributeError, OSError):
        return False
    return bool(made_from.get("sha256") == fingerprint(path).sha256)


def _shifted(d: Any, offset_s: float) -> Any:
    out = type(d)()
    out.FromNanoseconds(d.ToNanoseconds() + round(offset_s * 1e9))
    return out


def shift_result(res: asr_pb2.StreamingRecognitionResult, offset_s: float) -> asr_pb2.SpeechRecognitionResult:
    """A final of a stream that began `offset_s` into the file, with the file's offsets."""
    alternatives = []
    for alt in res.alternatives:
        a = asr_pb2.SpeechRecognitionAlternative()
        a.CopyFrom(alt)
        for item in (*a.segments, *a.words):
            item.start_offset.CopyFrom(_shifted(item.start_offset, offset_s))
            item.end_offset.CopyFrom(_shifted(item.end_offset, offset_s))
        alternatives.append(a)
    return asr_pb2.SpeechRecognitionResult(
        alternatives=alternatives,
        channel_tag=res.channel_tag,
        start_offset=_shifted(res.start_offset, offset_s),
        end_offset=_shifted(res.end_offset, offset_s),
        language_code=res.language_code,
    )


CUT_SLACK_S = 0.6  # a final ending this close to where a drain stopped hearing was cut by it (0.5 s silence)


def _seconds(d: Any) -> float:
    return float(d.ToNanoseconds()) / 1e9


def resume_point(
    finals: Sequence[asr_pb2.StreamingRecognitionResult], heard_s: float | None
) -> tuple[list[asr_pb2.StreamingRecognitionResult], float]:
    """A stream that stopped early: (the finals to keep, where the next stream starts), in the stream's
    own time. After RECONNECT the server heard `heard_s` and transcribed all of it; an utterance still
    being spoken then was cut there, mid-word: its final is dropped and the next stream starts at its
    beginning instead (and so for any final that runs past that start), so that nothing is lost, nothing
    is said twice, and no sentence is split. Without RECONNECT (a failed stream), everything up to the
    end of the last final was transcribed."""
    if heard_s is None:
        return list(finals), max((_seconds(f.end_offset) for f in finals), default=0.0)
    start = heard_s
    cut = [f for f in finals if _seconds(f.end_offset) >= heard_s - CUT_SLACK_S]
    if cut:
        start = min(_seconds(f.start_offset) for f in cut)
        while True:  # a final that runs past the new start goes too (another channel's)
            earlier = min(
                [start, *(_seconds(f.start_offset) for f in finals if _seconds(f.end_offset) > start)]
            )
            if earlier >= start:
                break
            start = earlier
    return [f for f in finals if _seconds(f.end_offset) <= start], start


def backoff_s(failures: int) -> float:
    """Seconds to wait before the next attempt after `failures` attempts in a row made no progress."""
    return 0.0 if failures == 0 else min(10.0, 2.0 ** (failures - 1))


def _rest(audio: Audio, offset_s: float) -> Audio:
    frame = min(len(audio.data) // audio.frame_bytes, round(offset_s * audio.sample_rate_hertz))
    return Audio(
        audio.data[frame * audio.frame_bytes :], audio.encoding, audio.sample_rate_hertz, audio.channels
    )


async def stream_whole(
    client: RecognizerClient, path: Path, opts: BulkOptions
) -> tuple[asr_pb2.RecognizeResponse, list[float]]:
    """A file too big for one Recognize: streamed (paced at `stream_speed` x real time; 0 = unpaced),
    its finals gathered into the RecognizeResponse that Recognize would have given, and where it was
    continued on a new stream. Raises Incomplete when the server keeps stopping before the file's end."""
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
            redact=opts.redact,  # type: ignore[arg-type]
        )
    )
    chunk_ms = 100.0
    pace = opts.stream_speed > 0
    frame_s = 1 / audio.sample_rate_hertz
    response = asr_pb2.RecognizeResponse()
    offset_s, failures = 0.0, 0
    resumed_at: list[float] = []
    while True:
        rest = _rest(audio, offset_s)
        chunks = paced(chunks_of(rest, chunk_ms), chunk_ms / 1000 / (opts.stream_speed or 1), pace)
        heard_s: float | None = None  # from RECONNECT: how far the server heard this stream
        finals: list[asr_pb2.StreamingRecognitionResult] = []  # this stream's, its own offsets
        call_metrics: asr_pb2.CallMetrics | None = None  # the stream's last response: its whole call
        problem = ""
        try:
            async with aclosing(client.stream(config, chunks, deadline_s=opts.timeout_s)) as responses:
                async for r in responses:
                    if r.speech_event_type == asr_pb2.StreamingRecognizeResponse.RECONNECT:
                        heard_s = _seconds(r.speech_event_offset)
                        problem = "the server asked to reconnect (draining)"
                    finals.extend(res for res in r.results if res.is_final)
                    if r.HasField("call_metrics"):
                        call_metrics = r.call_metrics
        except aio.AioRpcError as e:
            if e.code() not in STREAM_RETRYABLE:
                raise
            problem = f"{e.code().name}: {e.details()}"
        if problem:
            finals, reached_s = resume_point(finals, heard_s)
        response.results.extend(
            shift_result(f, offset_s) for f in finals if f.alternatives and f.alternatives[0].transcript
        )
        if not problem:
            if call_metrics is not None and not resumed_at:  # one stream heard the whole file
                response.call_metrics.CopyFrom(call_metrics)
            break  # the stream heard the whole rest of the file and ended OK
        reached = offset_s + reached_s
        if reached >= audio.duration_s - frame_s:
            break
        failures = 0 if reached > offset_s + frame_s else failures + 1
        if failures > opts.retries:
            raise Incomplete(
                f"incomplete: transcribed {reached:.2f} s of {audio.duration_s:.2f} s, then {problem} "
                f"(no progress in {failures} attempts; a rerun redoes it)"
            )
        await asyncio.sleep(backoff_s(failures))
        if failures == 0:
            offset_s = reached
            resumed_at.append(offset_s)
    response.total_audio_duration.FromNanoseconds(round(audio.duration_s * 1e9))
    response.results.sort(key=lambda r: (r.start_offset.ToNanoseconds(), r.channel_tag))
    return response, resumed_at


async def recognize_with_retries(
    client: RecognizerClient, path: Path, opts: BulkOptions
) -> asr_pb2.RecognizeResponse:
    """One Recognize of the whole file, sent again (backing off) while the server answers a retryable
    code, --retries times at most."""
    failures = 0
    while True:
        try:
            return await client.recognize_file(
                path,
                encoding=opts.encoding,
                rate=opts.rate,
                channels=opts.channels,
                separate_channels=opts.separate_channels,
                prompt=opts.prompt,
                language=opts.language,
                segment_offsets=True,
                deadline_s=opts.timeout_s,
                redact=opts.redact,
            )
        except aio.AioRpcError as e:
            failures += 1
            if e.code() not in RETRYABLE or failures > opts.retries:
                raise
            await asyncio.sleep(backoff_s(failures))


async def transcribe_file(client: RecognizerClient, path: Path, folder: Path, opts: BulkOptions) -> Outcome:
    json_path, srt_path = outputs_for(path, folder, opts.out_dir)
    rel_parent = json_path.parent.relative_to(opts.out_dir)
    names = (srt_path.name, json_path.name)

    def done() -> bool:
        existing = read_output(opts.out_dir, rel_parent, json_path.name)
        return is_done(existing, read_output(opts.out_dir, rel_parent, srt_path.name), path, opts)

    if await asyncio.to_thread(done):
        return Outcome(path, "skipped")
    try:
        made_from = await asyncio.to_thread(fingerprint, path)  # before reading it to transcribe it
        resumed_at: list[float] = []
        if made_from.size <= opts.max_recognize_bytes:
            method = "recognize"
            response = await recognize_with_retries(client, path, opts)
        else:
            method = "stream"
            response, resumed_at = await stream_whole(client, path, opts)
    except aio.AioRpcError as e:
        await asyncio.to_thread(remove_outputs, opts.out_dir, rel_parent, names)
        return Outcome(path, "failed", f"{e.code().name}: {e.details()}")
    except (Incomplete, OSError, ValueError, RuntimeError) as e:  # soundfile: RuntimeError
        await asyncio.to_thread(remove_outputs, opts.out_dir, rel_parent, names)
        return Outcome(path, "failed", str(e) if isinstance(e, Incomplete) else f"{type(e).__name__}: {e}")
    now = await asyncio.to_thread(path.stat)
    if (now.st_size, now.st_mtime_ns) != (made_from.size, made_from.mtime_ns):
        await asyncio.to_thread(remove_outputs, opts.out_dir, rel_parent, names)
        return Outcome(path, "failed", "the file changed while it was transcribed (a rerun redoes it)")
    srt_text = to_srt(response, opts.channel_names)
    body = record(response, str(path.relative_to(folder)), method, made_from, opts, srt_text, resumed_at)
    files = [
        (srt_path.name, srt_text.encode()),
        (json_path.name, (json.dumps(body, indent=2) + "\n").encode()),
    ]
    try:
        await asyncio.to_thread(write_outputs, opts.out_dir, rel_parent, files)
    except OSError as e:  # OutputError names the output (or the folder) it could not write
        await asyncio.to_thread(remove_outputs, opts.out_dir, rel_parent, names)
        where = opts.out_dir / e.filename if isinstance(e, OutputError) else json_path
        return Outcome(path, "failed", f"could not write {where}: {e.strerror or e}")
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
