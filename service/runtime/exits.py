"""asr-server's exit statuses, shared by the supervisor and the frontend's server."""

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1  # the engine died or hung, or frontends keep dying: a restart may help
EXIT_LOAD_FAILED = 2  # the model or a port could not be had: a restart with the same flags will not help
