"""The recognizer: the one API every door calls (`Recognizer`, `Stream`), with the limits it keeps across
streams (--max-streams, per-token shares, rate buckets), the call hub and the byte framing doors share.

Above the pipeline, below the doors: a door reaches the pipeline only through what this package exports."""
