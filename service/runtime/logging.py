"""Structured logs: one JSON object per line (for Cloud Logging / Loki), or plain text for people.

Callers attach fields with `log.info("msg", extra={"fields": {...}})`; they become top-level keys.
Audio and transcript text never go into logs unless --log-transcripts is on (the caller decides).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

_SEVERITY = {"WARNING": "WARNING", "CRITICAL": "CRITICAL"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            # "severity" is the key GKE's logging agent maps to the entry's level
            "severity": _SEVERITY.get(record.levelname, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Route the root logger to stderr in the chosen format (replacing earlier handlers)."""
    if fmt == "json":
        # Progress bars (transformers' weight loading) would put non-JSON lines into the log stream.
        os.environ.setdefault("TQDM_DISABLE", "1")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
