"""The per-stream work: audio decoding, endpointing, VAD, speculation, interims, results, redaction."""
