"""The operator's commands for the chat database (VCHAT_DATA_DIR, or DATABASE_URL):

    .venv/bin/python -m store migrate                  create or update the schema
    .venv/bin/python -m store users list
    .venv/bin/python -m store users add NAME [--admin] the password is asked for (or read
                                                       from standard input with --stdin)
    .venv/bin/python -m store users remove NAME

Every command brings the schema up to date first. Errors are one line and status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys

from sqlalchemy.exc import SQLAlchemyError

from store.accounts import AccountError, Accounts
from store.schema import connect, database_url, migrate
from store.setup import data_dir


async def run(args) -> str:
    engine = connect(database_url(data_dir()))
    try:
        before, after = await migrate(engine)
        if args.command == "migrate":
            return (f"schema at version {after}" if before == after
                    else f"schema brought from version {before} to {after}")
        accounts = Accounts(engine)
        if args.action == "list":
            rows = await accounts.list()
            return "\n".join(f"{a.identifier}\t{a.role}\t{a.created_at}" for a in rows) \
                or "no users"
        if args.action == "add":
            password = (sys.stdin.readline().rstrip("\n") if args.stdin
                        else getpass.getpass(f"password for {args.name}: "))
            account = await accounts.add(args.name, password,
                                         role="admin" if args.admin else "user")
            return f"added {account.identifier} ({account.role})"
        await accounts.remove(args.name)
        return f"removed {args.name}"
    finally:
        await engine.dispose()


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
    args = parser.parse_args(argv)
    try:
        print(asyncio.run(run(args)))
        return 0
    except (AccountError, ValueError, RuntimeError, OSError, SQLAlchemyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
