"""What every door on the HTTP port holds: the server's flags, the core, the bearer tokens."""

from __future__ import annotations

from aiohttp import web

from service.config import ServerConfig
from service.doors.shared.auth import TokenStore
from service.recognizer.recognizer import Recognizer


class HttpDoor:
    """A door on the HTTP port (runtime/http_server.py builds each with these and calls `register`)."""

    def __init__(self, config: ServerConfig, recognizer: Recognizer, tokens: TokenStore) -> None:
        self.config = config
        self.recognizer = recognizer
        self.tokens = tokens

    def register(self, app: web.Application) -> None:
        """Adds the door's routes to the HTTP port's application."""
        raise NotImplementedError
