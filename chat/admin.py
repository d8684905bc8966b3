"""The admin page, for accounts whose role is admin (checked in the database at every
request: an admin demoted or removed has no page from that moment):

    GET  /admin                     accounts, invites and their guests, usage charts,
                                    feedback with the rated replies, the engines' state
    POST /admin/accounts/{action}   add, remove, quota, logout, password (a form's `name`)
    POST /admin/invites/{action}    add, revoke, end (a form's `id`)

Every action is store/operator.py's, the command line's own code, and is logged with the
admin who did it. A new password or invite link is shown once, on the page that answers
the form (an invite's with a QR code to show a room); only their hashes are kept.

Anyone else gets nothing: a visitor with no login a page that says to log in, a user or a
guest the same 404 as a page that does not exist, from every route, and no action is done.
The forms are this site's only: the browser must say the post came from here
(chat/invites.py's `from_this_site`) and the form must carry a token made from the admin's
login session, which another site cannot read. The page runs no script and loads nothing:
its charts are inline SVG (chat/charts.py).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import date, datetime, timedelta, timezone
from urllib.parse import parse_qs

from chainlit.auth.cookie import get_token_from_cookies
from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse

from chat.charts import bars, stacked_columns
from chat.invites import from_this_site
from chat.logins import bearer, login_of
from chat.shares import PAGE_HEADERS, STYLE, html_page
from store.accounts import Account
from store.operator import Operator, Secret, utc_minute
from store.usage import Thumb, Usage

log = logging.getLogger(__name__)

FORM_BYTES = 4096
DAYS = 14  # the usage charts' period, unless ?days= says otherwise
MOST_DAYS = 92
FEEDBACK_SHOWN = 100
REPLY_CHARS = 600  # of a rated reply, on the page
NOT_FROM_HERE = "This form can only be sent from this site's own admin page."
ACCOUNT_ACTIONS = ("add", "remove", "quota", "logout", "password")
INVITE_ACTIONS = ("add", "revoke", "end")
HEADERS = {**PAGE_HEADERS, "X-Frame-Options": "DENY"}
ADMIN_STYLE = STYLE + """body{max-width:64rem}h2{margin-top:2rem;border-bottom:1px solid
rgba(128,128,128,.3)}td form{display:inline}input,select,button{font:inherit;margin:.1rem}
.said{padding:.6rem .9rem;border-radius:8px;background:rgba(0,158,115,.15)}
.error{padding:.6rem .9rem;border-radius:8px;background:rgba(213,94,0,.18)}
.secret{font:14px monospace;padding:.4rem;background:rgba(128,128,128,.12);
word-break:break-all}.qr svg{background:#fff;padding:8px}.ok{color:#009E73}.bad{color:#D55E00}
details{margin:.2rem 0}.reply{white-space:pre-wrap;font-size:13px;max-height:9rem;
overflow:auto}.num{text-align:right}"""


class NotAdmin(Exception):
    """The request is not an admin's: `status` and the page it gets."""

    def __init__(self, status: int):
        self.status = status


class AdminPage:
    def __init__(self, operator: Operator, usage: Usage,
                 viewer: Callable[[Request], Awaitable[object | None]],
                 state: Callable[[Request], Awaitable[dict]], profiles: Sequence[str],
                 secret: str):
        self.operator = operator
        self.usage = usage
        self.viewer = viewer  # the logged-in user of a request, or None
        self.state = state  # what /ready answers
        self.profiles = list(profiles)
        self.secret = secret.encode()
        self.router = APIRouter()
        self.router.add_api_route("/admin", self.page, methods=["GET"])
        self.router.add_api_route("/admin/accounts/{action}", self.account_action,
                                  methods=["POST"])
        self.router.add_api_route("/admin/invites/{action}", self.invite_action,
                                  methods=["POST"])

    # -- who may --------------------------------------------------------------------

    async def _admin(self, request: Request) -> str:
        """The admin's identifier; NotAdmin for anyone else."""
        user = await self.viewer(request)
        if user is None:
            raise NotAdmin(401)
        if await self.operator.accounts.role(user.identifier) != "admin":
            log.warning("admin page refused to %s (%s %s)", user.identifier, request.method,
                        request.url.path)
            raise NotAdmin(404)
        return user.identifier

    def _form_token(self, request: Request) -> str:
        """A token for the forms of this login session (none: no login)."""
        login = login_of(get_token_from_cookies(request.cookies) or bearer(request))
        if login is None:
            return ""
        return hmac.new(self.secret, f"admin-form:{login[0]}:{login[1]}".encode(),
                        hashlib.sha256).hexdigest()

    async def _form(self, request: Request) -> dict[str, str]:
        if int(request.headers.get("content-length") or 0) > FORM_BYTES:
            raise ValueError("That form is larger than any of this page's.")
        body = await request.body()
        if len(body) > FORM_BYTES:
            raise ValueError("That form is larger than any of this page's.")
        try:
            fields = parse_qs(body.decode(), keep_blank_values=True, max_num_fields=20)
        except (UnicodeDecodeError, ValueError):
            raise ValueError("That is not one of this page's forms.") from None
        return {k: v[0] for k, v in fields.items()}

    # -- routes ---------------------------------------------------------------------

    async def page(self, request: Request) -> HTMLResponse:
        try:
            admin = await self._admin(request)
        except NotAdmin as refused:
            return _refused(refused.status)
        return await self._page(request, admin)

    async def account_action(self, action: str, request: Request) -> HTMLResponse:
        return await self._act(request, action, ACCOUNT_ACTIONS, self._account)

    async def invite_action(self, action: str, request: Request) -> HTMLResponse:
        return await self._act(request, action, INVITE_ACTIONS, self._invite)

    async def _act(self, request: Request, action: str, actions: tuple[str, ...],
                   do: Callable[[str, str, dict, Request], Awaitable[str | Secret]]
                   ) -> HTMLResponse:
        try:
            admin = await self._admin(request)
        except NotAdmin as refused:
            return _refused(refused.status)
        if action not in actions:
            return _refused(404)
        if not from_this_site(request):
            log.warning("admin %s: a form from another site refused (%s)", admin,
                        request.url.path)
            return await self._page(request, admin, error=NOT_FROM_HERE, status=403)
        try:
            form = await self._form(request)
            if not hmac.compare_digest(form.get("token", ""), self._form_token(request)):
                log.warning("admin %s: a form without this session's token refused (%s)",
                            admin, request.url.path)
                return await self._page(request, admin, error=NOT_FROM_HERE, status=403)
            done = await do(action, admin, form, request)
        except ValueError as exc:  # AccountError and InviteError among them: said in words
            return await self._page(request, admin, error=str(exc), status=400)
        said = done.said if isinstance(done, Secret) else done
        log.info("admin %s: %s", admin, said)
        return await self._page(request, admin, said=done)

    async def _account(self, action: str, admin: str, form: dict,
                       request: Request) -> str | Secret:
        name = form.get("name", "").strip()
        if not name:
            raise ValueError("Which account? The form named none.")
        if action == "add":
            return await self.operator.add_user(name, None, form.get("role") == "admin")
        if name == admin and action in ("remove", "password", "logout"):
            raise ValueError("Not your own account from this page (you would be logged "
                             "out); `python -m store users` can.")
        if action == "remove":
            return await self.operator.remove_user(name)
        if action == "quota":
            return await self.operator.set_quota(name, form.get("tokens", ""))
        if action == "logout":
            return await self.operator.log_out(name)
        return await self.operator.set_password(name, None)

    async def _invite(self, action: str, admin: str, form: dict,
                      request: Request) -> str | Secret:
        if action == "add":
            # At the address the admin opened this page at: the one its guests open.
            return await self.operator.add_invite(form.get("uses", ""), form.get("expires", ""),
                                                  form.get("profile") or None, self.profiles,
                                                  str(request.base_url))
        invite = form.get("id", "").strip()
        if not re.fullmatch(r"[0-9a-f]{8}", invite):
            raise ValueError("Which invite? The form named none.")
        if action == "revoke":
            return await self.operator.revoke_invite(invite)
        return await self.operator.end_invite(invite)

    # -- the page -------------------------------------------------------------------

    async def _page(self, request: Request, admin: str, said: str | Secret | None = None,
                    error: str | None = None, status: int = 200) -> HTMLResponse:
        days = _days(request.query_params.get("days"))
        token = self._form_token(request)
        accounts = await self.operator.accounts.list()
        top = ""
        if error:
            top = f'<p class=error role=alert>{html.escape(error)}</p>'
        elif isinstance(said, Secret):
            top = _secret_html(said)
        elif said:
            top = f'<p class=said role=status>{html.escape(said)}.</p>'
        until = datetime.now(timezone.utc).date()
        since = until - timedelta(days=days - 1)
        thumbs = await self.usage.feedback(since, until)  # (the usage report's too)
        names = _names(accounts)
        body = "".join([
            f"<h1>Admin</h1><p class=meta>Logged in as {html.escape(admin)} · "
            f'<a href="/">back to the chat</a></p>{top}',
            _engines_html(await self.state(request)),
            await self._usage_html(names, since, until, thumbs),
            self._accounts_html(request, accounts, admin, token),
            await self._invites_html(request, accounts, token),
            _feedback_html(names, days, thumbs)])
        return html_page("Admin", body, status, ADMIN_STYLE, HEADERS)

    def _accounts_html(self, request: Request, accounts: list[Account], admin: str,
                       token: str) -> str:
        act = str(request.url_for("account_action", action="_")).rsplit("/", 1)[0]
        rows = []
        for a in accounts:
            if a.kind == "guest":
                continue
            name = html.escape(a.identifier)
            hidden = _hidden(token, name=a.identifier)
            quota = "" if a.daily_tokens is None else str(a.daily_tokens)
            own = a.identifier == admin
            rows.append(
                f"<tr><td>{name}</td><td>{a.role}</td><td>{a.kind}</td>"
                f"<td>{html.escape(a.created_at[:16])}</td><td>"
                f'<form method=post action="{act}/quota">{hidden}<input name=tokens size=9 '
                f'value="{quota}" placeholder="none" aria-label="daily tokens of {name}">'
                f"<button>Set</button></form></td><td>" + ("" if own else
                f'<form method=post action="{act}/logout">{hidden}<button>Log out</button>'
                f"</form>" + (f'<form method=post action="{act}/password">{hidden}<button>'
                              f"New password</button></form>" if a.kind == "password" else "")
                + f'<details><summary>Remove…</summary><form method=post action="{act}/'
                f'remove">{hidden}<button>Remove {name} and its chats</button></form>'
                f"</details>") + "</td></tr>")
        return (
            "<h2>Accounts</h2><table><tr><th>Name</th><th>Role</th><th>Login</th>"
            "<th>Since (UTC)</th><th>Tokens a day</th><th></th></tr>" + "".join(rows) +
            f'</table><form method=post action="{act}/add"><p>{_hidden(token)}'
            '<input name=name required maxlength=200 placeholder="new account name" '
            'aria-label="new account name"> <label><input type=checkbox name=role '
            'value=admin> admin</label> <button>Add account</button> '
            "<span class=meta>(a password is made and shown once)</span></p></form>")

    async def _invites_html(self, request: Request, accounts: list[Account],
                            token: str) -> str:
        act = str(request.url_for("invite_action", action="_")).rsplit("/", 1)[0]
        guests: dict[str | None, list[Account]] = {}
        for a in accounts:
            if a.kind == "guest":
                guests.setdefault(a.invite, []).append(a)
        rows = []
        for i in reversed(await self.operator.invites.list()):
            state = i.state()
            hidden = _hidden(token, id=i.id)
            theirs = sorted(guests.get(i.id, []), key=lambda g: g.created_at)
            listed = "".join(f"<li>{html.escape(g.display_name or '?')} "
                             f"<span class=meta>({html.escape(g.identifier)}, joined "
                             f"{html.escape(g.created_at[:16])})</span></li>" for g in theirs)
            rows.append(
                f"<tr><td>{i.id}</td><td>{state}</td><td class=num>{i.used}/{i.uses}</td>"
                f"<td>{html.escape(i.profile or 'any')}</td>"
                f"<td>{utc_minute(i.expires_at)}</td><td>"
                + (f"<details><summary>{len(theirs)} guest(s)</summary><ul>{listed}</ul>"
                   "</details>" if theirs else "none") + "</td><td>"
                + ("" if state == "revoked" else f'<form method=post action="{act}/revoke">'
                   f"{hidden}<button>Revoke</button></form>")
                + f'<details><summary>End…</summary><form method=post action="{act}/end">'
                f"{hidden}<button>End: remove its guests and their chats</button></form>"
                "</details></td></tr>")
        profiles = "".join(f'<option value="{html.escape(p)}">{html.escape(p)}</option>'
                           for p in self.profiles)
        table = ("<table><tr><th>Invite</th><th>State</th><th>Used</th><th>Profile</th>"
                 "<th>Until</th><th>Guests</th><th></th></tr>" + "".join(rows) + "</table>"
                 if rows else "<p>No invites yet.</p>")
        open_demo = guests.get(None, [])
        return (
            f"<h2>Invites</h2>{table}"
            + (f"<p class=meta>{len(open_demo)} guest(s) of the open demo.</p>"
               if open_demo else "")
            + f'<form method=post action="{act}/add"><p>{_hidden(token)}'
            '<label>Uses <input name=uses type=number min=1 value=50 required></label> '
            '<label>Expires in <input name=expires value="2h" size=5 required></label> '
            '<label>Profile <select name=profile><option value="">any</option>'
            f"{profiles}</select></label> <button>Create invite</button></p></form>")

    async def _usage_html(self, names: dict, since: date, until: date,
                          thumbs: list[Thumb]) -> str:
        days = (until - since).days + 1
        day_lines = await self.usage.days(since, until)
        links = " · ".join(f'<a href="?days={n}">{n} days</a>' for n in (7, 14, 30, 90))
        if not day_lines:
            return (f"<h2>Usage</h2><p class=meta>The last {days} days (UTC) · {links}</p>"
                    "<p>No turns in this period.</p>")
        columns = [(since + timedelta(days=n)).isoformat() for n in range(days)]
        profiles = sorted({d.profile for d in day_lines})
        tokens = {p: [0] * days for p in profiles}
        turns = {p: [""] * days for p in profiles}
        for d in day_lines:
            n = (datetime.fromisoformat(d.day).date() - since).days
            tokens[d.profile][n] = d.prompt_tokens + d.reply_tokens
            turns[d.profile][n] = f"{d.turns} turn(s)"
        per_account: dict[str, list[int]] = {}
        per_profile: dict[str, list[int]] = {}
        for line in await self.usage.report(since, until, thumbs):
            for table, key in ((per_account, names.get(line.identifier, line.identifier)),
                               (per_profile, line.profile)):
                row = table.setdefault(key or "(operator key)", [0, 0])
                row[0] += line.prompt_tokens + line.reply_tokens
                row[1] += line.turns
        ranked = sorted(per_account.items(), key=lambda kv: -kv[1][0])[:25]
        profile_rows = "".join(
            f"<tr><td>{html.escape(p)}</td><td class=num>{t:,}</td><td class=num>{n:,}</td>"
            "</tr>" for p, (t, n) in sorted(per_profile.items()))
        return (
            f"<h2>Usage</h2><p class=meta>The last {days} days (UTC) · {links}</p>"
            "<h3>Tokens per day, by profile</h3>"
            + stacked_columns(columns, tokens, "tokens", turns)
            + "<h3>Tokens by account</h3>"
            + bars([(name, t, f"{n} turn(s)") for name, (t, n) in ranked], "tokens")
            + "<h3>By profile</h3><table><tr><th>Profile</th><th>Tokens</th><th>Turns</th>"
            f"</tr>{profile_rows}</table>")


def _feedback_html(names: dict, days: int, thumbs: list[Thumb]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(t.at[:16])}</td>"
        f"<td>{html.escape(names.get(t.identifier, t.identifier or '(API)'))}</td>"
        f"<td>{html.escape(t.profile)}</td><td class={'ok' if t.thumbs == 'up' else 'bad'}>"
        f"{'👍' if t.thumbs == 'up' else '👎'} {t.thumbs}</td>"
        f"<td>{html.escape(t.comment or '')}</td><td><div class=reply>"
        f"{html.escape(_cut(t.reply or ''))}</div></td></tr>"
        for t in thumbs[:FEEDBACK_SHOWN])
    up = sum(t.thumbs == "up" for t in thumbs)
    return (f"<h2>Feedback</h2><p class=meta>{up} up, {len(thumbs) - up} down in the "
            f"last {days} days" + (f"; the newest {FEEDBACK_SHOWN} shown" if
                                   len(thumbs) > FEEDBACK_SHOWN else "") + "</p>"
            + ("<table><tr><th>When (UTC)</th><th>Who</th><th>Profile</th><th>Rating</th>"
               f"<th>Comment</th><th>The reply</th></tr>{rows}</table>" if thumbs else ""))


def _days(value: str | None) -> int:
    try:
        return min(MOST_DAYS, max(1, int(value))) if value else DAYS
    except ValueError:
        return DAYS


def _names(accounts: list[Account]) -> dict[str | None, str]:
    """Who an identifier is, as the page shows it: a guest by its chosen name."""
    return {a.identifier: (f"{a.display_name} (guest {a.identifier[6:]})"
                           if a.kind == "guest" and a.display_name else a.identifier)
            for a in accounts}


def _cut(text: str) -> str:
    return text if len(text) <= REPLY_CHARS else text[:REPLY_CHARS] + "…"


def _hidden(token: str, **fields: str) -> str:
    return "".join(f'<input type=hidden name="{k}" value="{html.escape(v)}">'
                   for k, v in {"token": token, **fields}.items())


def _secret_html(done: Secret) -> str:
    said = f"<p class=said role=status>{html.escape(done.said)}.</p>"
    if done.invite is None:
        return (said + "<p>The new password, shown only now: give it to its user.</p>"
                f"<p class=secret>{html.escape(done.secret)}</p>")
    import segno  # the QR code

    qr = segno.make(done.secret, error="m").svg_inline(scale=6, dark="#000", light="#fff")
    return (said + "<p>The invite link, shown only now (only its hash is kept): share it, "
            "or show this code to the room.</p>"
            f'<p class=secret id=invite-link>{html.escape(done.secret)}</p>'
            f'<div class=qr role=img aria-label="QR code of the invite link">{qr}</div>')


def _engines_html(state: dict) -> str:
    status = state.get("status", "?")
    rows = []
    for name, e in (state.get("engines") or {}).items():
        kv = (f"{e.get('kv_held', 0):,} of {e['kv_tokens']:,}" if e.get("kv_tokens")
              else "—")
        hit = e.get("prefix_cache_hit_rate")
        rows.append(
            f"<tr><td>{html.escape(name)}</td><td class={'ok' if e.get('healthy') else 'bad'}>"
            f"{'healthy' if e.get('healthy') else 'restarting' if e.get('restarting') else 'down'}"
            f"</td><td class=num>{e.get('restarts', 0)}</td>"
            f"<td class=num>{e.get('admitted', 0)}/{e.get('max_admitted', 0)}</td>"
            f"<td class=num>{e.get('queued', 0)}/{e.get('max_queued', 0)}</td>"
            f"<td class=num>{kv}</td>"
            f"<td class=num>{'—' if hit is None else f'{hit:.0%}'}</td>"
            f"<td class=num>{e.get('preempted', 0)}</td></tr>")
    fronts = state.get("front_ends") or {}
    store = state.get("store") or {}
    return (
        f"<h2>Engines</h2><p>Status: <strong class={'ok' if status == 'ok' else 'bad'}>"
        f"{html.escape(str(status))}</strong> · turns in flight: "
        f"{state.get('turns_in_flight', 0)} · database: "
        + ("reachable" if store.get("reachable") else "<span class=bad>unreachable</span>")
        + (f", {store['failed_writes']} failed write(s)" if store.get("failed_writes") else "")
        + (" · front ends: " + ", ".join(f"{html.escape(k)}: {html.escape(str(v))}"
                                          for k, v in sorted(fronts.items())) if fronts else "")
        + "</p><table><tr><th>Engine</th><th>State</th><th>Restarts</th><th>Turns in / "
        "seats</th><th>Waiting / room</th><th>KV tokens held</th><th>Prefix hits</th>"
        f"<th>Preempted</th></tr>{''.join(rows)}</table>")


def _refused(status: int) -> HTMLResponse:
    if status == 401:
        return html_page("Log in", '<h1>Log in first</h1><p><a href="/login">Log in</a> with '
                         "an admin account, then open this page again.</p>", 401, ADMIN_STYLE,
                         HEADERS)
    return html_page("Not found", "<h1>Not found</h1>", 404, ADMIN_STYLE, HEADERS)
