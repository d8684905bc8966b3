"""The operator's commands for the chat database (VCHAT_DATA_DIR, or DATABASE_URL):

    .venv/bin/python -m store migrate                  create or update the schema
    .venv/bin/python -m store users list
    .venv/bin/python -m store users add NAME [--admin] the password is asked for (or read
                                                       from standard input with --stdin)
    .venv/bin/python -m store users remove NAME        (and its chats, API keys, sessions)
    .venv/bin/python -m store users password NAME      a new password (asked for, or
                                                       --stdin); every session ends
    .venv/bin/python -m store users logout NAME        end every session of NAME now
    .venv/bin/python -m store keys add NAME [--label L] a new API key for NAME, shown once
    .venv/bin/python -m store keys list [NAME]
    .venv/bin/python -m store keys revoke ID

Every command brings the schema up to date first. Errors are one line and status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys

from sqlalchemy.exc import SQLAlchemyError

from store.accounts import AccountError, Accounts
from store.api_keys import ApiKeys
from store.schema import connect, database_url, migrate
from store.setup import data_dir


async def run(args) -> str:
    engine = connect(database_url(data_dir()))
    try:
        before, after = await migrate(engine)
        if args.command == "migrate":
            return (f"schema at version {after}" if before == after
                    else f"schema brought from version {before} to {after}")
        if args.command == "keys":
            return await keys_command(ApiKeys(engine), args)
        accounts = Accounts(engine)
        if args.action == "list":
            rows = await accounts.list()
            return "\n".join(f"{a.identifier}\t{a.role}\t{a.created_at}" for a in rows) \
                or "no users"
        if args.action == "add":
            account = await accounts.add(args.name, read_password(args),
                                         role="admin" if args.admin else "user")
            return f"added {account.identifier} ({account.role})"
        if args.action == "password":
            ended = await accounts.set_password(args.name, read_password(args))
            return f"changed the password of {args.name}; {ended} session(s) ended"
        if args.action == "logout":
            ended = await accounts.log_out_everywhere(args.name)
            return f"{ended} session(s) of {args.name} ended"
        chats = await accounts.remove(args.name)
        return f"removed {args.name} and its {chats} chat(s); its sessions ended"
    finally:
        await engine.dispose()


def read_password(args) -> str:
    return (sys.stdin.readline().rstrip("\n") if args.stdin
            else getpass.getpass(f"password for {args.name}: "))


async def keys_command(keys: ApiKeys, args) -> str:
    if args.action == "add":
        made, key = await keys.add(args.name, args.label)
        return (f"API key {made.id} for {made.identifier} (shown only now):\n{key}")
    if args.action == "list":
        rows = await keys.list(args.name)
        return "\n".join(f"{k.id}\t{k.identifier}\t{k.label or ''}\t{k.created_at}"
                         for k in rows) or "no API keys"
    await keys.revoke(args.id)
    return f"revoked {args.id}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m store", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("migrate")
    users = sub.add_parser("users").add_subparsers(dest="action", required=True)
    users.add_parser("list")
    add = users.add_parser("add")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true")
    add.add_argument("--stdin", action="store_true", help="read the password from stdin")
    users.add_parser("remove").add_argument("name")
    password = users.add_parser("password")
    password.add_argument("name")
    password.add_argument("--stdin", action="store_true", help="read the password from stdin")
    users.add_parser("logout").add_argument("name")
    keys = sub.add_parser("keys").add_subparsers(dest="action", required=True)
    make = keys.add_parser("add")
    make.add_argument("name")
    make.add_argument("--label", help="what the key is for")
    keys.add_parser("list").add_argument("name", nargs="?")
    keys.add_parser("revoke").add_argument("id")
    args = parser.parse_args(argv)
    try:
        print(asyncio.run(run(args)))
        return 0
    except (AccountError, ValueError, RuntimeError, OSError, SQLAlchemyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
