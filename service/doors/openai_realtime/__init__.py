"""The OpenAI Realtime transcription door: `/v1/realtime?intent=transcription` (WebSocket) on the HTTP port.
door.py serves the socket on the core; protocol.py reads and builds the protocol's shapes."""
