"""API keys: who may call what, and which tenant a key stands for."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from proxy.api.auth import Access, AuthError, Caller, identify, presented_key

KEYS = Access(api_keys=MappingProxyType({"sk-alice": "alice", "sk-bob": "bob"}),
              admin_key="sk-admin")
CHAT = "/v1/chat/completions"
ADMIN = "/admin/checkpoints"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_no_keys_configured_everyone_is_admin_and_names_their_tenant() -> None:
    assert identify(Access(), CHAT, {}) == Caller(tenant=None, admin=True)
    assert identify(Access(), ADMIN, {}) == Caller(tenant=None, admin=True)


def test_the_tenant_comes_from_the_key_in_either_header() -> None:
    assert identify(KEYS, CHAT, _bearer("sk-alice")) == Caller("alice", admin=False)
    assert identify(KEYS, "/v1/messages", {"x-api-key": "sk-bob"}) == Caller("bob", False)
    assert presented_key({"Authorization": "bearer  sk-x "}) == "sk-x"


@pytest.mark.parametrize(("path", "headers", "status"), [
    (CHAT, {}, 401),
    (CHAT, _bearer("sk-nobody"), 401),
    (CHAT, _bearer("sk-alic"), 401),  # a prefix of a key is no key
    (CHAT, {"Authorization": "Basic sk-alice"}, 401),
    (CHAT, _bearer("sk-admin"), 401),  # the admin key is not an API key
    (ADMIN, {}, 401),
    (ADMIN, _bearer("sk-nobody"), 401),
    (ADMIN, _bearer("sk-alice"), 403),
    (ADMIN + "/abc", {"x-api-key": "sk-bob"}, 403),
])
def test_refusals(path: str, headers: dict[str, str], status: int) -> None:
    with pytest.raises(AuthError) as e:
        identify(KEYS, path, headers)
    assert e.value.status == status


def test_admin_key_opens_the_admin_routes_and_health_stays_open() -> None:
    assert identify(KEYS, ADMIN, _bearer("sk-admin")).admin
    assert identify(KEYS, "/health", {}) == Caller(tenant=None, admin=False)
    assert identify(KEYS, "/metrics", {}).tenant is None


def test_keys_without_an_admin_key_close_the_admin_routes_to_everyone() -> None:
    access = Access(api_keys=MappingProxyType({"sk-alice": "alice"}))
    with pytest.raises(AuthError):
        identify(access, ADMIN, _bearer("sk-alice"))
    with pytest.raises(AuthError):
        identify(access, ADMIN, _bearer(""))


def test_an_admin_key_alone_guards_only_the_admin_routes() -> None:
    access = Access(admin_key="sk-admin")
    assert identify(access, CHAT, {}) == Caller(tenant=None, admin=False)
    with pytest.raises(AuthError):
        identify(access, ADMIN, {})
    assert identify(access, ADMIN, _bearer("sk-admin")).admin


def _basic(user: str, password: str) -> dict[str, str]:
    import base64

    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_the_live_page_is_an_admin_route_and_a_browser_sends_the_key_as_a_password() -> None:
    assert identify(KEYS, "/ui", _basic("admin", "sk-admin")).admin
    assert identify(KEYS, "/ui", _basic("", "sk-admin")).admin
    assert identify(KEYS, "/ui", _basic("sk-admin", "")).admin  # typed as the user name
    assert identify(KEYS, "/admin/ui.json", _basic("anyone", "sk-admin")).admin
    for headers, status in [({}, 401), (_basic("admin", "sk-alice"), 403),
                            (_basic("admin", "wrong"), 401), (_bearer("sk-bob"), 403),
                            ({"Authorization": "Basic %%%"}, 401)]:
        with pytest.raises(AuthError) as e:
            identify(KEYS, "/ui", headers)
        assert e.value.status == status
    assert identify(Access(), "/ui", {}).admin  # no keys: open, as /admin is
    assert identify(KEYS, "/uix", _bearer("sk-alice")).tenant == "alice"  # not the page
    assert presented_key({"Authorization": "Basic %%%", "x-api-key": "sk-bob"}) == "sk-bob"
