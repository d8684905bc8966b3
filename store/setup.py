"""What the app needs from its data folder before it serves anyone: the database at the
current schema, Chainlit's session-signing secret, and a first admin.

- The data folder: VCHAT_DATA_DIR, default ./data (git-ignored). It holds chat.db (SQLite,
  unless DATABASE_URL points elsewhere) and auth-secret.
- CHAINLIT_AUTH_SECRET signs the login tokens. From the environment when set; else the one
  generated on the first start and kept in the data folder (owner-only), so a restart keeps
  everyone logged in and nothing secret is ever committed.
- The first admin: VCHAT_ADMIN_USER / VCHAT_ADMIN_PASSWORD when there is no account yet; with
  neither set and no account, a local admin `admin` with a generated password, which
  `first_admin` returns once for the caller to print (it is stored only as a hash).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from engine.settings import setting
from store.accounts import Accounts, generate_password
from store.schema import one_at_a_time

SECRET_FILE = "auth-secret"


def data_dir(env: dict | None = None) -> Path:
    return Path(setting("VCHAT_DATA_DIR", env))


def auth_secret(folder: Path, env: dict | None = None) -> str:
    """The environment's CHAINLIT_AUTH_SECRET, else the data folder's, made on first use."""
    given = setting("CHAINLIT_AUTH_SECRET", env)
    if given:
        return given
    path = Path(folder) / SECRET_FILE
    if not path.exists():  # written whole beside it, then linked: never seen half-made
        path.parent.mkdir(parents=True, exist_ok=True)
        made = path.with_name(f".{SECRET_FILE}.{os.getpid()}")
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(48) + "\n")
        try:
            os.link(made, path)
        except FileExistsError:  # another process on this folder made it first: theirs
            pass
        finally:
            made.unlink()
    return path.read_text().strip()


async def first_admin(accounts: Accounts, env: dict | None = None
                      ) -> tuple[str, str | None] | None:
    """Create the first admin if there is no account. Returns None when accounts exist,
    else (name, generated password or None when the environment gave it). One process at
    a time (replicas starting together make one admin)."""
    async with one_at_a_time(accounts.engine):
        return await _first_admin(accounts, env)


async def _first_admin(accounts: Accounts, env: dict | None) -> tuple[str, str | None] | None:
    if await accounts.count():
        return None
    name, password = setting("VCHAT_ADMIN_USER", env), setting("VCHAT_ADMIN_PASSWORD", env)
    if bool(name) != bool(password):
        raise ValueError("set both VCHAT_ADMIN_USER and VCHAT_ADMIN_PASSWORD, or neither")
    if name:
        await accounts.add(name, password, role="admin")
        return name, None
    password = generate_password()
    await accounts.add("admin", password, role="admin")
    return "admin", password
