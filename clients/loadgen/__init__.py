"""`asr-loadgen` (see clients/loadgen/cli.py for its modes), one module per job:

- `audio`: a manifest's audio as wire bytes, line noise, a live call's audio, a stream's config
- `run`: the run mode (concurrency levels of per-utterance streams, each level summarised)
- `capacity`: the capacity mode (N live calls at once: kept up? CPU per call?)
- `report`: a run's markdown table, the compare table, a run's output files
- `plot`: throughput and p95 latency against concurrency
"""

from clients.loadgen.cli import main

__all__ = ["main"]
