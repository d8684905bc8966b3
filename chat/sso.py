"""Single sign-on: who may enter, and as what, when a company's identity provider vouches
for them, by OpenID Connect or through a trusted proxy's header.

- OpenID Connect goes through Chainlit's generic OAuth provider (its OAUTH_GENERIC_*
  variables, README "Single sign-on"): Chainlit sends the browser to the provider, takes the
  code back, exchanges it for an access token and reads the user's claims from the
  provider's userinfo endpoint with it. A tampered, replayed or expired code or token fails
  there (the provider refuses it) and the browser is sent back to the login page. Then
  `Policy` decides: the e-mail must be verified (when the provider says), its domain one of
  VCHAT_SSO_DOMAINS, the user in one of VCHAT_SSO_GROUPS when those are named; a member of
  VCHAT_SSO_ADMIN_GROUPS is an admin. The account is made on the first login (store/
  accounts.py, kind "sso", no password) and its role follows the provider at each login; a
  password account of the same name is not taken over.
- A trusted header (VCHAT_HEADER_AUTH, e.g. X-Forwarded-Email, behind oauth2-proxy or an
  SSO gateway): taken only from the proxy's own addresses (VCHAT_HEADER_AUTH_PROXIES); a
  request from anywhere else is refused before Chainlit reads the header. The address is the
  connection's own, recorded before uvicorn replaces it with a forwarded one
  (`remember_peers`), so a client cannot name itself the proxy in X-Forwarded-For. Its
  value is read as UTF-8 (`header_text`: Starlette reads headers as Latin-1, and made
  `jörg@` into `jÃ¶rg@`).
- Either way the login opens a session as a password login does (chat/logins.py); after
  that, Chainlit's own signed token (its cookie) is what each request shows.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from starlette.responses import JSONResponse

from engine import ConfigError
from engine.settings import setting
from store.accounts import AccountError, Accounts

log = logging.getLogger(__name__)

PEER = "vchat.peer"  # the ASGI scope's key for the connection's own address
HEADER_LOGIN_PATH = "/auth/header"


def listed(value: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (value or "").split(",") if p.strip())


@dataclass(frozen=True)
class Policy:
    """Who single sign-on lets in, and who of them is an admin."""
    domains: tuple[str, ...] = ()  # e-mail domains, lower case; empty: any
    groups: tuple[str, ...] = ()  # one of them needed; empty: none needed
    admin_groups: tuple[str, ...] = ()
    groups_claim: str = "groups"

    @classmethod
    def from_settings(cls, env: Mapping[str, str] | None = None) -> Policy:
        return cls(tuple(d.lower().lstrip("@") for d in listed(setting("VCHAT_SSO_DOMAINS", env))),
                   listed(setting("VCHAT_SSO_GROUPS", env)),
                   listed(setting("VCHAT_SSO_ADMIN_GROUPS", env)),
                   setting("VCHAT_SSO_GROUPS_CLAIM", env))

    def role(self, name: str | None, groups: Iterable[str] = (),
             verified: bool | None = None) -> tuple[str | None, str]:
        """("admin" or "user", "") for someone let in; (None, why not) otherwise."""
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            return None, "no usable user name or e-mail in the provider's answer"
        if verified is False:
            return None, f"{name!r}: the provider has not verified this e-mail address"
        domain = name.rpartition("@")[2].lower() if "@" in name else ""
        if self.domains and domain not in self.domains:
            return None, f"{name!r}: domain {domain or '(none)'!r} is not let in"
        groups = set(groups)
        if self.groups and not groups & set(self.groups):
            return None, f"{name!r}: in none of the groups let in"
        return ("admin" if groups & set(self.admin_groups) else "user"), ""


def groups_of(value) -> list[str]:
    """A groups claim as a list: a JSON list, or one comma-separated string (headers)."""
    if isinstance(value, str):
        return list(listed(value))
    if isinstance(value, (list, tuple)):
        return [g for g in value if isinstance(g, str)]
    return []


def claim_verified(claims: Mapping) -> bool | None:
    value = claims.get("email_verified")
    if isinstance(value, str):  # some providers send "true"/"false"
        return value.strip().lower() == "true"
    return value if isinstance(value, bool) else None


class SingleSignOn:
    """The login callbacks app.py registers with Chainlit. `open_session(identifier)`
    gives the metadata a login's token carries (chat/logins.py's Logins.open)."""

    def __init__(self, accounts: Accounts, open_session: Callable[[str], Awaitable[dict]],
                 policy: Policy | None = None):
        self.accounts, self.open_session = accounts, open_session
        self.policy = policy or Policy.from_settings()

    async def let_in(self, name: str | None, groups: list[str], verified: bool | None,
                     how: str):
        """A chainlit User for someone the provider vouched for, or None (logged why)."""
        import chainlit as cl

        role, why = self.policy.role(name, groups, verified)
        if role is None:
            log.warning("%s login refused: %s", how, why)
            return None
        try:
            account = await self.accounts.single_sign_on(name.strip(), role)
        except AccountError as exc:
            log.warning("%s login refused: %s", how, exc)
            return None
        if account is None:
            log.warning("%s login refused: %r is a password account here, not taken over by "
                        "single sign-on", how, name)
            return None
        return cl.User(identifier=account.identifier, metadata={
            "role": account.role, "provider": how,
            **await self.open_session(account.identifier)})

    async def oauth(self, provider_id: str, token: str, raw_user_data: dict, default_user,
                    id_token: str | None = None):
        """Chainlit's oauth_callback: the userinfo claims it read with the access token."""
        claims = raw_user_data if isinstance(raw_user_data, dict) else {}
        return await self.let_in(default_user.identifier,
                                 groups_of(claims.get(self.policy.groups_claim)),
                                 claim_verified(claims), f"single sign-on ({provider_id})")


class HeaderLogin:
    """Chainlit's header_auth_callback, for a proxy that has logged the user in."""

    def __init__(self, sso: SingleSignOn, header: str, groups_header: str | None,
                 proxies: Iterable[str]):
        self.sso, self.header, self.groups_header = sso, header.lower(), groups_header
        try:
            self.proxies = [ipaddress.ip_network(p, strict=False) for p in proxies]
        except ValueError as exc:
            raise ConfigError("environment", "VCHAT_HEADER_AUTH_PROXIES", str(exc)) from None
        if not self.proxies:
            raise ConfigError("environment", "VCHAT_HEADER_AUTH_PROXIES",
                              "name the proxy's addresses: without them anyone could send "
                              f"{header} and log in as anybody")

    @classmethod
    def from_settings(cls, sso: SingleSignOn) -> HeaderLogin | None:
        header = setting("VCHAT_HEADER_AUTH")
        if not header:
            return None
        return cls(sso, header, setting("VCHAT_HEADER_AUTH_GROUPS"),
                   listed(setting("VCHAT_HEADER_AUTH_PROXIES")))

    def trusted(self, address: str | None) -> bool:
        try:
            ip = ipaddress.ip_address(address or "")
        except ValueError:
            return False
        return any(ip in network for network in self.proxies)

    async def login(self, headers: Mapping[str, str]):
        groups = groups_of(header_text(headers.get(self.groups_header.lower(), ""))) \
            if self.groups_header else []
        return await self.sso.let_in(header_text(headers.get(self.header)), groups, None,
                                     "header")

    def install(self, http) -> None:
        """POST /auth/header from anywhere but the proxies is refused, unread."""
        remember_peers()

        @http.middleware("http")
        async def from_proxies_only(request, call_next):
            if request.url.path != HEADER_LOGIN_PATH:
                return await call_next(request)
            peer = request.scope.get(PEER) or (request.client.host if request.client else None)
            if not self.trusted(peer):
                log.warning("header login from %s refused: not a trusted proxy", peer)
                return JSONResponse({"detail": "Logins by header are taken only from the "
                                     "sign-in proxy."}, status_code=403)
            return await call_next(request)


def header_text(value: str | None) -> str | None:
    """A header's value as the UTF-8 that proxies send: Starlette gives its bytes read as
    Latin-1. Bytes that are not UTF-8 keep the Latin-1 reading (what they were then)."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:  # not UTF-8, or not read from bytes (already text)
        return value


def remember_peers() -> None:
    """uvicorn replaces a trusted proxy's address with the one it forwards (X-Forwarded-For)
    before the app sees the request; keep the connection's own in the scope first."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    if getattr(ProxyHeadersMiddleware, "_vchat_peers", False):
        return
    forward = ProxyHeadersMiddleware.__call__

    async def call(self, scope, receive, send):
        if scope.get("type") in ("http", "websocket") and scope.get("client"):
            scope[PEER] = scope["client"][0]
        return await forward(self, scope, receive, send)

    ProxyHeadersMiddleware.__call__ = call
    ProxyHeadersMiddleware._vchat_peers = True
