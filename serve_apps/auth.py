"""The API key, failing closed: with a key, every route but ``/health`` and ``/health/ready``
requires ``Authorization: Bearer <key>``; without one, only clients on the ingress's own host
(loopback) are served unless the config says ``insecure_no_auth`` on purpose."""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from serve_apps.config import AppConfig
from serve_apps.errors import openai_error

OPEN_PATHS = ("/health", "/health/ready")
"""Routes answered without the key (they give no model names without it)."""


def read_api_key(config: AppConfig) -> str | None:
    """The API key from ``api_key_file`` or the ``api_key_env`` variable, or None."""
    if config.api_key_file:
        path = Path(config.api_key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"api_key_file {path} does not exist")
        text = path.read_text().strip()
        if not text:
            raise ValueError(f"api_key_file {path} is empty")
        return text.splitlines()[0].strip()
    return os.environ.get(config.api_key_env or "", "").strip() or None


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost`` and the rest of 127.0.0.0/8."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Auth:
    """Who may call: the key, or (no key) loopback clients only, or everyone on purpose."""

    key: str | None
    open_to_all: bool

    @classmethod
    def from_config(cls, config: AppConfig) -> Auth:
        key = read_api_key(config)
        if key and config.insecure_no_auth:
            raise ValueError("insecure_no_auth is set but an API key is configured too "
                             f"({config.api_key_file or config.api_key_env}): remove one")
        return cls(key, config.insecure_no_auth)

    def has_key(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        return bool(self.key) and scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.key.encode())

    def refusal(self, authorization: str, client_host: str | None) -> str | None:
        """Why a request with this ``Authorization`` header from this client is refused, or None."""
        if self.key:
            return None if self.has_key(authorization) else \
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'."
        if self.open_to_all or (client_host is not None and is_loopback(client_host)):
            return None
        return ("This server has no API key configured, so it answers only clients on its own host. "
                "Set an API key (SWIFTKV_API_KEY, or api_key_env / api_key_file) or, to serve everyone "
                "without one, insecure_no_auth.")


class ApiKeyMiddleware:
    """ASGI middleware applying the app's :class:`Auth` (``app.state.auth``) to every HTTP request
    but the open paths, before routing, so unknown routes need the key too."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            if path not in OPEN_PATHS:
                headers = dict(scope.get("headers") or [])
                authorization = headers.get(b"authorization", b"").decode("latin-1")
                client = scope.get("client")
                why = scope["app"].state.auth.refusal(authorization, client[0] if client else None)
                if why:
                    await openai_error(401, why)(scope, receive, send)
                    return
        await self.app(scope, receive, send)
