"""The operator's commands for the chat database (VCHAT_DATA_DIR, or DATABASE_URL):

    .venv/bin/python -m store migrate                  create or update the schema
    .venv/bin/python -m store users list
    .venv/bin/python -m store users add NAME [--admin] the password is asked for (or read
                                                       from standard input with --stdin)
    .venv/bin/python -m store users remove NAME        (and its chats, API keys, sessions)
    .venv/bin/python -m store users password NAME      a new password (asked for, or
                                                       --stdin); every session ends
    .venv/bin/python -m store users logout NAME        end every session of NAME now
    .venv/bin/python -m store users quota NAME N       at most N tokens a day (UTC), chat and
                                                       API together; "none": no quota
    .venv/bin/python -m store keys add NAME [--label L] a new API key for NAME, shown once
    .venv/bin/python -m store keys list [NAME]
    .venv/bin/python -m store keys revoke ID
    .venv/bin/python -m store invites add --uses N --expires 2h [--profile NAME]
                                                       an invite link for a demo: up to N
                                                       people chat as guests until it
                                                       expires (s, m, h or d), in that
                                                       profile only if named; shown once
    .venv/bin/python -m store invites list
    .venv/bin/python -m store invites revoke ID        refused from now on; its guests'
                                                       sessions end
    .venv/bin/python -m store invites end ID           revoked, and its guests removed
                                                       now with their chats
    .venv/bin/python -m store invites expire [--days N]
                                                       guests older than N days (default
                                                       VCHAT_GUEST_RETENTION_DAYS) removed
                                                       with their chats (the app does it
                                                       every hour)
    .venv/bin/python -m store usage [--since DATE] [--until DATE] [--json] [--daily]
                                                       turns, tokens, stopped replies and
                                                       thumbs per user and profile (--daily:
                                                       turns and tokens per day and profile)
    .venv/bin/python -m store feedback [--since DATE] [--until DATE]
                                                       every thumb and its comment
    .venv/bin/python -m store export [--since DATE] [--until DATE] [--user NAME]
                                [--format json|md] [--out FILE]
                                                       chats with a message in the period
                                                       (store/export.py's JSON by default)

Dates are UTC days, YYYY-MM-DD, both ends included.

Every command brings the schema up to date first. Errors are one line and status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
import time
from dataclasses import asdict

from sqlalchemy.exc import SQLAlchemyError

from engine.settings import setting
from store import export
from store.accounts import AccountError, Accounts
from store.api_keys import ApiKeys
from store.operator import Operator, utc_minute
from store.schema import connect, database_url, migrate
from store.setup import data_dir
from store.usage import DayLine, Usage, UsageLine, parse_day


async def run(args) -> str:
    engine = connect(database_url(data_dir()))
    try:
        before, after = await migrate(engine)
        if args.command == "migrate":
            return (f"schema at version {after}" if before == after
                    else f"schema brought from version {before} to {after}")
        if args.command == "keys":
            return await keys_command(ApiKeys(engine), args)
        operator = Operator(engine, setting("VCHAT_GUEST_CHATS"),
                            setting("VCHAT_GUEST_RETENTION_DAYS"))
        if args.command == "invites":
            return await invites_command(operator, args)
        if args.command == "usage" and args.daily:
            return days_table(await Usage(engine).days(
                parse_day(args.since, "--since"), parse_day(args.until, "--until")), args.json)
        if args.command == "usage":
            return usage_table(await Usage(engine).report(
                parse_day(args.since, "--since"), parse_day(args.until, "--until")), args.json)
        if args.command == "export":
            return await export_command(engine, args)
        if args.command == "feedback":
            thumbs = await Usage(engine).feedback(parse_day(args.since, "--since"),
                                                  parse_day(args.until, "--until"))
            return "\n".join(
                f"{t.at}\t{t.identifier}\t{t.profile}\t{t.thumbs}\tchat {t.thread_id}"
                f"{chr(9) + ' '.join(t.comment.split()) if t.comment else ''}"
                for t in thumbs) or "no feedback in this period"
        if args.action == "list":
            rows = await Accounts(engine).list()
            return "\n".join(
                f"{a.identifier}\t{a.role}\t{a.kind}\t{a.created_at}\t"
                f"{'no quota' if a.daily_tokens is None else f'{a.daily_tokens} tokens/day'}"
                for a in rows) or "no users"
        if args.action == "quota":
            return await operator.set_quota(args.name, args.tokens)
        if args.action == "add":
            return (await operator.add_user(args.name, read_password(args), args.admin)).said
        if args.action == "password":
            return (await operator.set_password(args.name, read_password(args))).said
        if args.action == "logout":
            return await operator.log_out(args.name)
        return await operator.remove_user(args.name)
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


def profile_names() -> list[str]:
    from engine import load_config

    return [p.name for p in load_config().profiles]


async def invites_command(operator: Operator, args) -> str:
    if args.action == "add":
        made = await operator.add_invite(
            args.uses, args.expires, args.profile,
            profile_names() if args.profile is not None else (),
            setting("VCHAT_PUBLIC_URL"))
        return (f"{made.said} (the link is shown only now; VCHAT_PUBLIC_URL sets its "
                f"address):\n{made.secret}")
    if args.action == "list":
        now = time.time()
        return "\n".join(
            f"{i.id}\t{i.state(now)}\t{i.used}/{i.uses} used\t{i.profile or 'any profile'}\t"
            f"until {utc_minute(i.expires_at)}\t{i.created_at}"
            for i in await operator.invites.list()) or "no invites"
    if args.action == "revoke":
        return await operator.revoke_invite(args.id)
    if args.action == "end":
        return await operator.end_invite(args.id)
    return await operator.expire_guests(args.days)


def usage_table(lines: list[UsageLine], as_json: bool) -> str:
    if as_json:
        return json.dumps([asdict(line) for line in lines], indent=1)
    return table(("user", "profile", "turns", "prompt tokens", "reply tokens", "stopped", "up",
                  "down"),
                 [(line.identifier or "(operator key)", line.profile, line.turns,
                   line.prompt_tokens, line.reply_tokens, line.stopped, line.thumbs_up,
                   line.thumbs_down) for line in lines])


def days_table(lines: list[DayLine], as_json: bool) -> str:
    if as_json:
        return json.dumps([asdict(line) for line in lines], indent=1)
    return table(("day", "profile", "turns", "prompt tokens", "reply tokens"),
                 [(d.day, d.profile, d.turns, d.prompt_tokens, d.reply_tokens) for d in lines])


def table(head: tuple, lines: list[tuple]) -> str:
    """Columns padded to their widest value, the first two to the left."""
    rows = [head, *lines]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) if i < 2 else str(v).rjust(w)
                               for i, (v, w) in enumerate(zip(r, widths))) for r in rows) \
        if lines else "no turns in this period"


async def export_command(engine, args) -> str:
    chats = await export.chats_in(engine, parse_day(args.since, "--since"),
                                  parse_day(args.until, "--until"), args.user)
    body = export.as_json(chats) if args.format == "json" else export.as_markdown(chats)
    if args.out is None:
        return body
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(body)
    return f"{len(chats)} chat(s) written to {args.out}"


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
    quota = users.add_parser("quota")
    quota.add_argument("name")
    quota.add_argument("tokens", help='tokens a day, 0 or more, or "none"')
    report = sub.add_parser("usage")
    report.add_argument("--since")
    report.add_argument("--until")
    report.add_argument("--json", action="store_true")
    report.add_argument("--daily", action="store_true", help="per day and profile")
    thumbs = sub.add_parser("feedback")
    thumbs.add_argument("--since")
    thumbs.add_argument("--until")
    dump = sub.add_parser("export")
    dump.add_argument("--since")
    dump.add_argument("--until")
    dump.add_argument("--user", help="only this user's chats")
    dump.add_argument("--format", choices=("json", "md"), default="json")
    dump.add_argument("--out", help="a file (default: standard output)")
    keys = sub.add_parser("keys").add_subparsers(dest="action", required=True)
    make = keys.add_parser("add")
    make.add_argument("name")
    make.add_argument("--label", help="what the key is for")
    keys.add_parser("list").add_argument("name", nargs="?")
    keys.add_parser("revoke").add_argument("id")
    invites = sub.add_parser("invites").add_subparsers(dest="action", required=True)
    invite = invites.add_parser("add")
    invite.add_argument("--uses", required=True, help="how many people may join")
    invite.add_argument("--expires", required=True, help="e.g. 90m, 2h, 7d")
    invite.add_argument("--profile", help="the one chat profile its guests get")
    invites.add_parser("list")
    invites.add_parser("revoke").add_argument("id")
    invites.add_parser("end").add_argument("id")
    invites.add_parser("expire").add_argument("--days", type=float)
    args = parser.parse_args(argv)
    try:
        print(asyncio.run(run(args)))
        return 0
    except (AccountError, ValueError, RuntimeError, OSError, SQLAlchemyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
