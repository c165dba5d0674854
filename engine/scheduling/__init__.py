"""Every decision about requests and no torch (pyproject.toml's import contracts hold it): the scheduler,
its pure policy, the request's lifecycle and per-row state, and what a finished window means."""
