"""A real OpenID Connect provider for the single sign-on tests: panva's certified `oidc-provider`
(npm, pinned in tests/e2e/oidc/package.json) under node, started by tests/e2e/oidc/provider.mjs
with one confidential client (client_secret_post, code flow, no PKCE: Chainlit's OAuth client
sends none). Testing against the real thing catches what a hand-written fake would get wrong.

    with OidcProvider().start(client_id="app", client_secret="s",
                              redirect_uris=["http://127.0.0.1:8000/auth/oauth/generic/callback"],
                              accounts={"alice@example.com": {"groups": ["staff"]}}) as op:
        code = await log_in(op, "alice@example.com", redirect_uri, "app")
        token = await tokens(op, code, redirect_uri, "app", "s")

Login is oidc-provider's built-in development page (any login id, any password); consent is
granted automatically (the provider's OIDC_CONSENT=auto), though `log_in` also gets through
the dev consent page when it is asked for with consent="page". Everything is on 127.0.0.1,
never `localhost`: the provider's interaction cookies are bound to the host name.
"""

from __future__ import annotations

import fcntl
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx

from tools.chainlit_client import free_port

FOLDER = Path(__file__).resolve().parent.parent / "tests" / "e2e" / "oidc"
SCOPE = "openid email profile groups"

# The dev login page (oidc-provider's lib/views/login.js): one form posting to
# /interaction/<uid>/login with a hidden prompt=login, a text field "login" (any id is an
# account), a password field "password" (any value passes) and a "Sign-in" submit button.
# Both dev pages have <title>Sign-in</title>; their <h1> is "Sign-in" or "Authorize". They
# @import a Google font: offline, that request fails at once and changes nothing.
LOGIN_FIELD = 'input[name="login"]'
PASSWORD_FIELD = 'input[name="password"]'
SUBMIT = 'button[type="submit"]'
# The dev consent page (lib/views/interaction.js), only with consent="page": a form with a
# hidden prompt=consent and a "Continue" submit button (the same selector as SUBMIT).
CONSENT_PAGE = 'input[name="prompt"][value="consent"]'  # to wait for, with state="attached"
CONSENT_SUBMIT = 'button[type="submit"]'
PASSWORD = "any password"


def install() -> None:
    """`npm ci` in tests/e2e/oidc when its node_modules is missing or older than the lock file,
    so that a fresh checkout (CI) and a changed pin both get the right oidc-provider. Several
    test processes may call this at once: a lock file serialises them."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"{tool} not found: the OIDC provider needs node 20+ and npm "
                                    "(Debian: nodejs npm)")
    lock = Path(tempfile.gettempdir()) / "vchat-oidc-npm.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if installed():
            return
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=FOLDER,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"npm ci in {FOLDER} failed: {done.stdout}{done.stderr}")


def installed() -> bool:
    """Whether node_modules was installed from the current package-lock.json (npm writes its
    own node_modules/.package-lock.json on every install)."""
    marker = FOLDER / "node_modules" / ".package-lock.json"
    return (marker.exists()
            and marker.stat().st_mtime >= (FOLDER / "package-lock.json").stat().st_mtime)


class OidcProvider:
    """provider.mjs as a subprocess, its output in a log file (`log_path`, kept after stop so
    that a failed test can show it)."""

    def __init__(self, log_path: Path | None = None):
        self.log_path = log_path or Path(tempfile.mkdtemp(prefix="vchat-oidc-")) / "oidc.log"
        self.port = 0
        self.discovery: dict[str, Any] = {}
        self._process: subprocess.Popen | None = None

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None, client_id: str = "vchat",
              client_secret: str = "vchat-secret", redirect_uris: Iterable[str] = (),
              accounts: Mapping[str, Mapping[str, Any]] | None = None,
              access_ttl: int = 3600, id_token_ttl: int = 3600, code_ttl: int = 60,
              consent: str = "auto",
              timeout: float = 30) -> "OidcProvider":
        """Install if needed, start on `port` (a free one if None) and wait until discovery
        answers; `self.discovery` is then the provider's openid-configuration."""
        install()
        self.port = port or free_port()
        env = {**os.environ, "OIDC_PORT": str(self.port), "OIDC_ISSUER": self.issuer,
               "OIDC_CLIENT_ID": client_id, "OIDC_CLIENT_SECRET": client_secret,
               "OIDC_REDIRECT_URIS": ",".join(redirect_uris),
               "OIDC_ACCOUNTS": json.dumps(dict(accounts or {})),
               "OIDC_ACCESS_TOKEN_TTL": str(access_ttl), "OIDC_ID_TOKEN_TTL": str(id_token_ttl),
               "OIDC_CODE_TTL": str(code_ttl),
               "OIDC_CONSENT": consent}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(["node", str(FOLDER / "provider.mjs")], cwd=FOLDER,
                                             env=env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        url = f"{self.issuer}/.well-known/openid-configuration"
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"the OIDC provider exited ({self._process.returncode}):\n"
                                   + self.log())
            try:
                answer = httpx.get(url, timeout=2)
                if answer.status_code == 200:
                    self.discovery = answer.json()
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the OIDC provider did not answer {url}:\n" + self.log())
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> "OidcProvider":
        if self._process is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def authorization_url(provider: OidcProvider, client_id: str, redirect_uri: str,
                      state: str = "x", scope: str = SCOPE) -> str:
    """The authorization request a client such as Chainlit's sends (code flow, no PKCE)."""
    query = urlencode({"client_id": client_id, "redirect_uri": redirect_uri,
                       "response_type": "code", "scope": scope, "state": state})
    return f"{provider.discovery['authorization_endpoint']}?{query}"


async def log_in(provider: OidcProvider, login_id: str, redirect_uri: str, client_id: str,
                 state: str = "x", scope: str = SCOPE) -> str:
    """What a browser does on the provider's side of a login: the authorization request, the
    dev login page (and the consent page, if shown), following the interaction redirects
    with the provider's cookies. Returns the `code` of the final redirect to redirect_uri,
    which is not fetched. Raises if the provider redirects back with an error instead."""
    url = authorization_url(provider, client_id, redirect_uri, state, scope)
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(url)
        for _ in range(20):
            if answer.is_redirect:
                url = urljoin(url, answer.headers["location"])
                if url.split("?")[0] == redirect_uri.split("?")[0]:
                    query = parse_qs(urlsplit(url).query)
                    if "code" not in query:
                        raise RuntimeError(f"the provider redirected with no code: {url}")
                    if query.get("state") != [state]:
                        raise RuntimeError(f"the provider changed state: {url}")
                    return query["code"][0]
                answer = await client.get(url)
                continue
            if answer.status_code != 200:
                raise RuntimeError(f"{url} answered {answer.status_code}: {answer.text[:2000]}")
            action = re.search(r'<form[^>]*action="([^"]+)"', answer.text)
            prompt = re.search(r'name="prompt" value="(\w+)"', answer.text)
            if not action or not prompt:
                raise RuntimeError(f"{url} is neither the login nor the consent page: "
                                   + answer.text[:2000])
            form = {"prompt": prompt.group(1)}
            if form["prompt"] == "login":
                form |= {"login": login_id, "password": PASSWORD}
            url = urljoin(url, html.unescape(action.group(1)))
            answer = await client.post(url, data=form)
    raise RuntimeError(f"no redirect to {redirect_uri} after 20 steps; last at {url}")


async def tokens(provider: OidcProvider, code: str, redirect_uri: str, client_id: str,
                 client_secret: str) -> dict[str, Any]:
    """The token endpoint's answer for `code` (access_token, id_token, expires_in, ...), the
    client authenticating with client_secret_post as Chainlit's generic OAuth client does."""
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.post(provider.discovery["token_endpoint"], data={
            "grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
            "client_id": client_id, "client_secret": client_secret})
    if answer.status_code != 200:
        raise RuntimeError(f"token endpoint answered {answer.status_code}: {answer.text}")
    return answer.json()
