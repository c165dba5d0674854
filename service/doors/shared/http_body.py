"""The HTTP port's body allowance, shared by the port (service/runtime/http_server.py, aiohttp's
client_max_size) and the door that reads multipart forms (service/doors/openai_http.py)."""

from __future__ import annotations

# On top of the largest recording a door takes (--max-recognize-bytes): multipart boundaries and text fields.
BODY_OVERHEAD_BYTES = 1 << 20
