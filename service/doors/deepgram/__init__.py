"""The Deepgram-compatible door: live `/v1/listen` (WebSocket) and pre-recorded `POST /v1/listen`."""
