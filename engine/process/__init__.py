"""The engine in its own process: the engine process (core_process.py), a frontend's client of it
(client.py), the wire between them (ipc.py) and the CPUs a process may use (cpus.py). No torch import
here (pyproject.toml's import contracts): the engine process loads it when it builds its engine."""
