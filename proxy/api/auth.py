"""API keys: who is calling, which tenant they are, whether they may use the admin routes.

- No key configured (the default): nobody is asked for one, everyone may use the admin
  routes, and the tenant is what the request says (``X-Statecache-Tenant``, else
  ``user``), as before keys existed; the server binds to 127.0.0.1 unless told otherwise.
- ``server.api_keys`` (key -> tenant): every request but ``/health`` and ``/metrics``
  needs a known key, and its tenant is the key's, whatever the request says.
- ``server.admin_key``: the admin routes need it (with keys configured but no admin key,
  nobody may use them); ``server.admin = false`` removes them.

A key arrives as ``Authorization: Bearer K`` (OpenAI clients), ``x-api-key: K``
(Anthropic clients) or ``Authorization: Basic`` with K as the password (a browser on the
live page, ``/ui``, an admin route). Keys are compared in constant time, and every configured key is
compared, so timing tells nothing about which one nearly matched.
"""

from __future__ import annotations

import base64
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

OPEN_PATHS = ("/health", "/metrics")  # no tenant data: load balancers and scrapers
ADMIN_PREFIX = "/admin/"
UI_PATH = "/ui"  # the live page (proxy/api/ui.py): an admin route


class AuthError(Exception):
    """A request without the right key: 401 (none or unknown) or 403 (not allowed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True, frozen=True)
class Caller:
    tenant: str | None  # None: the request names its own (no keys configured)
    admin: bool


@dataclass(slots=True, frozen=True)
class Access:
    api_keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    admin_key: str = ""
    admin_routes: bool = True

    @property
    def keyed(self) -> bool:
        return bool(self.api_keys) or bool(self.admin_key)


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if scheme.lower() == "basic" and token.strip():  # a browser: the key as the password
        try:
            user, _, password = base64.b64decode(token.strip(), validate=True).decode(
                "utf-8").partition(":")
        except ValueError:  # not base64, not UTF-8
            user = password = ""
        if password or user:
            return password or user
    return headers.get("x-api-key") or None


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIX) or path == UI_PATH


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _tenant_of(access: Access, key: str) -> str | None:
    found = None
    for known, tenant in access.api_keys.items():
        if _equal(key, known) and found is None:
            found = tenant
    return found


def identify(access: Access, path: str, headers: Mapping[str, str]) -> Caller:
    """Who is calling ``path``; AuthError when the key is missing, unknown or not enough."""
    if not access.keyed:
        return Caller(tenant=None, admin=True)
    key = presented_key(headers)
    is_admin = bool(access.admin_key) and key is not None and _equal(key, access.admin_key)
    if is_admin_path(path):
        if is_admin:
            return Caller(tenant=None, admin=True)
        if key is None:
            raise AuthError(401, "the admin routes need the admin key "
                                 "(Authorization: Bearer <key>)")
        raise AuthError(403 if _tenant_of(access, key) is not None else 401,
                        "this key may not use the admin routes")
    if path in OPEN_PATHS or not access.api_keys:
        return Caller(tenant=None, admin=is_admin)
    if key is None:
        raise AuthError(401, "an API key is required (Authorization: Bearer <key> "
                             "or x-api-key: <key>)")
    tenant = _tenant_of(access, key)
    if tenant is None:
        raise AuthError(401, "unknown API key")
    return Caller(tenant=tenant, admin=is_admin)
