"""What benchmark scripts and tests share to drive a real server from the outside and measure it.

- `harness.server`: `asr-server` (this checkout's, or an older git ref's) as a subprocess on free
  loopback ports: start, wait for SERVING, scrape /metrics, stop.
- `harness.metrics`: a Prometheus exposition, parsed by prometheus_client, with sums, per-label
  breakdowns and deltas between two scrapes.
- `harness.usage`: wall time, CPU seconds and peak memory of a process tree.
- `harness.stats`: the one percentile every report uses.

A package of the project (not a folder of scripts/, not tests/support/) because the shipped
`asr-loadgen` uses its metrics, usage and stats, and because scripts must not import test-only code.
Nothing here is imported by the server itself.
"""
