"""The admin page (chat/admin.py) on the real server (the labelled stand-in engine: the
model does not matter here) with real logins and the real SQLite database: an admin's
actions do what the command line's do (store/operator.py) and are logged with who did
them; a user, a guest, a logged-out visitor and another site get nothing from any of its
routes and change nothing. (An admin making an invite a guest joins by, in a real browser:
tests/e2e/test_chat_page.py.)"""

import html
import re
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from chat.charts import bars, stacked_columns
from store.schema import connect, database_url
from tests.test_accounts import STAND_IN, add_user, store_command, store_run
from tests.test_invites import costs_written, guest_of, join, link_token
from tests.test_trials import rate
from tools.chainlit_client import TEST_USER, ChatClient, serving
from tools.polling import until

ROUTES = [("GET", "/admin")] + \
    [("POST", f"/admin/accounts/{a}") for a in ("add", "remove", "quota", "logout", "password")] + \
    [("POST", f"/admin/invites/{a}") for a in ("add", "revoke", "end")]
HOSTILE_NAME = "<b>Ada</b><script>x()</script>"


@pytest.fixture(scope="module")
async def server():
    async with serving(STAND_IN, timeout=120) as srv:
        add_user(srv, "bea", "bea's long password")
        add_user(srv, "cal", "cal's long password")
        yield srv


def token_in(page: str) -> str:
    return re.search(r'name="token" value="([0-9a-f]{64})"', page)[1]


async def act(http: httpx.AsyncClient, path: str, here: str, **fields) -> httpx.Response:
    """A form of the admin page sent as the browser sends it, with the page's token."""
    token = token_in((await http.get("/admin")).text)
    return await http.post(path, data={"token": token, **fields}, headers={"origin": here})


def said(page: httpx.Response) -> str:
    found = re.search(r"<p class=(?:said|error) role=(?:status|alert)>(.*?)</p>", page.text)
    return html.unescape(found[1]) if found else ""


async def test_an_admins_actions_are_the_command_lines_and_are_logged(server):
    admin = ChatClient(server.url, "Latency-first")
    async with admin.api() as http:
        page = await http.get("/admin")
        assert page.status_code == 200
        for section in ("Engines", "Usage", "Accounts", "Invites", "Feedback"):
            assert f"<h2>{section}</h2>" in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
        assert "<script" not in page.text and "http" not in re.sub(
            r'(href|action)="[^"]*"|xmlns="[^"]*"', "", page.text)  # nothing from elsewhere

        # An account made on the page logs in with the password shown once.
        made = await act(http, "/admin/accounts/add", server.url, name="dee")
        assert made.status_code == 200 and said(made) == "added dee (user)."
        password = html.unescape(re.search(r"<p class=secret>(.*?)</p>", made.text)[1])
        dee = ChatClient(server.url, "Latency-first", user="dee", password=password)
        await dee.connect()
        assert "dee\tuser\tpassword" in store_command(server, "users", "list")

        quota = await act(http, "/admin/accounts/quota", server.url, name="dee", tokens="5,000")
        assert said(quota) == "dee: at most 5,000 tokens a day (UTC)."
        assert "5000 tokens/day" in store_command(server, "users", "list")
        bad = await act(http, "/admin/accounts/quota", server.url, name="dee", tokens="lots")
        assert bad.status_code == 400 and "a whole number of tokens" in said(bad)

        out = await act(http, "/admin/accounts/logout", server.url, name="dee")
        assert re.fullmatch(r"[1-9]\d* session\(s\) of dee ended\.", said(out)), said(out)
        assert not await until(lambda: dee.sio.connected, lambda up: not up, timeout=10)

        reset = await act(http, "/admin/accounts/password", server.url, name="dee")
        new_password = html.unescape(re.search(r"<p class=secret>(.*?)</p>", reset.text)[1])
        assert new_password != password
        with pytest.raises(PermissionError):
            await dee.login()
        dee.password = new_password
        await dee.login()

        # Not the admin's own account from the page (it would lock itself out).
        own = await act(http, "/admin/accounts/remove", server.url, name=TEST_USER)
        assert own.status_code == 400 and TEST_USER in store_command(server, "users", "list")

        gone = await act(http, "/admin/accounts/remove", server.url, name="dee")
        assert said(gone) == "removed dee and its 0 chat(s); its sessions ended."
        assert "dee" not in store_command(server, "users", "list")
        missing = await act(http, "/admin/accounts/remove", server.url, name="dee")
        assert missing.status_code == 400 and said(missing) == "no user 'dee'"

        # An invite: its link and QR code once; a guest joins by it and chats.
        invite = await act(http, "/admin/invites/add", server.url, uses="3", expires="2h",
                           profile="Throughput-first")
        link = html.unescape(re.search(r"<p class=secret id=invite-link>(.*?)</p>",
                                       invite.text)[1])
        assert link.startswith(server.url + "/invite/")
        assert 'aria-label="QR code of the invite link"><svg' in invite.text
        invite_id = re.fullmatch(r"invite ([0-9a-f]{8}): 3 use\(s\) until .*\.", said(invite))[1]
        assert f"{invite_id}\topen\t0/3 used\tThroughput-first" in \
            store_command(server, "invites", "list")
        wrong = await act(http, "/admin/invites/add", server.url, uses="3", expires="2h",
                          profile="No such profile")
        assert wrong.status_code == 400 and "one of Latency-first" in said(wrong)

    guest = await guest_of(server, link_token(link), HOSTILE_NAME)
    reply = await guest.send("Hello from a guest")
    assert reply.shown, reply.notes
    assert reply.reply["metadata"]["profile"] == "Throughput-first", reply.reply["metadata"]
    await costs_written(server, guest, 1)
    await guest.close()

    async with admin.api() as http:
        page = (await http.get("/admin")).text
        # The guest under its invite, and its turn in the usage charts, by its name (escaped).
        shown = html.escape(HOSTILE_NAME, quote=False)
        assert f"<li>{shown} <span class=meta>(guest-" in page
        assert HOSTILE_NAME not in page and "<script>x()" not in page
        assert re.search(rf"<title>{re.escape(html.escape(HOSTILE_NAME))} \(guest [0-9a-f]{{8}}"
                         r"\): \d[\d,]* tokens, 1 turn\(s\)</title>", page), page
        # (In the invite's profile, where the turn ran, not the one the page asked for.)
        assert re.search(r"<title>\d{4}-\d\d-\d\d · Throughput-first: [\d,]+ tokens, "
                         r"1 turn\(s\)</title>", page)

        revoked = await act(http, "/admin/invites/revoke", server.url, id=invite_id)
        assert said(revoked) == f"revoked invite {invite_id}; 1 guest session(s) ended."
        ended = await act(http, "/admin/invites/end", server.url, id=invite_id)
        assert said(ended) == f"revoked invite {invite_id}; 1 guest(s) removed with their chats."
        assert (await join(server, link_token(link), "Late")).status_code == 410

    log = server.log_path.read_text(errors="replace")
    for line in ("added dee (user)", "dee: at most 5,000 tokens a day (UTC)",
                 "changed the password of dee", "removed dee and its 0 chat(s)",
                 f"revoked invite {invite_id}; 1 guest(s) removed"):
        assert f"admin {TEST_USER}: {line}" in log, line
    assert password not in log and new_password not in log and link_token(link) not in log


async def test_users_guests_visitors_and_other_sites_get_nothing_and_change_nothing(server):
    invite = store_command(server, "invites", "add", "--uses", "2", "--expires", "1h")
    invite_id = invite.split()[1].rstrip(":")
    guest = await guest_of(server, link_token(invite), "Gus")
    users_before = store_command(server, "users", "list")
    invites_before = store_command(server, "invites", "list")
    forms = {"name": "cal", "tokens": "1", "uses": "5", "expires": "1h", "id": invite_id,
             "token": "0" * 64}
    bea = ChatClient(server.url, "Latency-first", user="bea", password="bea's long password")
    async with bea.api() as as_bea, httpx.AsyncClient(
            base_url=server.url, cookies={"access_token": guest._token}) as as_guest, \
            httpx.AsyncClient(base_url=server.url) as visitor:
        for who, http, status in (("user", as_bea, 404), ("guest", as_guest, 404),
                                  ("visitor", visitor, 401)):
            for method, path in ROUTES:
                answer = await http.request(method, path, data=forms if method == "POST"
                                            else None, headers={"origin": server.url})
                assert answer.status_code == status, (who, path, answer.status_code)
                shown = answer.text.split("</head>")[-1]
                assert "cal" not in shown and "Accounts" not in shown, (who, path, shown)
                assert "<form" not in shown and invite_id not in shown
    await guest.close()
    assert store_command(server, "users", "list") == users_before
    # A guest has no password to set, on the page (no button) or the command line.
    gus = next(line.split()[0] for line in users_before.splitlines() if "\tguest\t" in line)
    refused = store_run(server, "users", "password", gus, "--stdin", stdin="a long password\n")
    assert refused.returncode == 1 and "logs in by an invite" in refused.stderr
    assert store_command(server, "invites", "list") == invites_before

    # An admin's own cookie, sent by another site's page or without the page's token.
    admin = ChatClient(server.url, "Latency-first")
    async with admin.api() as http:
        token = token_in((await http.get("/admin")).text)
        for headers, data in (({"origin": "https://elsewhere.example"}, {"token": token}),
                              ({"sec-fetch-site": "cross-site"}, {"token": token}),
                              ({"origin": server.url}, {}),
                              ({"origin": server.url}, {"token": "f" * 64})):
            crossed = await http.post("/admin/accounts/remove", headers=headers,
                                      data={**data, "name": "cal"})
            assert crossed.status_code == 403 and "this site's own admin page" in said(crossed)
        # An oversized form, and a name made to break out of a statement: refused in
        # words, and nothing removed (every statement binds its values).
        big = await http.post("/admin/accounts/remove", headers={"origin": server.url},
                              data={"token": token, "name": "cal", "pad": "x" * 10_000})
        assert big.status_code == 400 and "larger than any" in said(big)
        for name in ("cal' OR '1'='1", 'cal"; DELETE FROM accounts; --'):
            injected = await http.post("/admin/accounts/remove", headers={"origin": server.url},
                                       data={"token": token, "name": name})
            assert injected.status_code == 400 and said(injected) == f"no user {name!r}"
        # The token of one login session does not work in another.
        async with admin.api() as other:
            theirs = await other.post("/admin/accounts/remove", headers={"origin": server.url},
                                      data={"token": token, "name": "cal"})
            assert theirs.status_code == 403
    assert "cal\tuser" in store_command(server, "users", "list")
    assert "a form from another site refused" in server.log_path.read_text(errors="replace")


async def test_an_admin_removed_or_logged_out_has_no_page_from_that_moment(server):
    add = store_run(server, "users", "add", "ops2", "--admin", "--stdin",
                    stdin="ops2's long password\n")
    assert add.returncode == 0, add.stderr
    ops2 = ChatClient(server.url, "Latency-first", user="ops2", password="ops2's long password")
    async with ops2.api() as http:
        assert (await http.get("/admin")).status_code == 200
        store_command(server, "users", "remove", "ops2")
        later = await http.get("/admin")
        assert later.status_code == 401 and "Accounts" not in later.text


async def test_usage_per_day_and_feedback_are_the_command_lines(server):
    bea = ChatClient(server.url, "Latency-first", user="bea", password="bea's long password")
    await bea.connect()
    turn = await bea.send("Count this turn")
    assert turn.shown
    rated = await rate(bea, turn.reply["id"], 0, "<i>not what I asked</i>")
    assert rated.status_code == 200, rated.text
    await costs_written(server, bea, 1)
    await bea.close()
    # The rating on the page, with its comment and the reply it rates (escaped).
    async with ChatClient(server.url, "Latency-first").api() as http:
        page = (await http.get("/admin")).text
    feedback = page.split("<h2>Feedback</h2>")[1]
    assert "&lt;i&gt;not what I asked&lt;/i&gt;" in feedback and "<i>not" not in feedback
    assert html.escape(turn.shown[:100], quote=False) in feedback
    assert re.search(r"<td>bea</td><td>Latency-first</td><td class=bad>👎 down</td>", feedback)
    printed = store_command(server, "usage", "--daily")
    assert printed.splitlines()[0].split() == ["day", "profile", "turns", "prompt", "tokens",
                                               "reply", "tokens"]
    db = connect(database_url(Path(server.env["VCHAT_DATA_DIR"])))
    try:
        async with db.connect() as conn:
            turns = (await conn.execute(text(
                'SELECT COUNT(*) FROM usage WHERE NOT "pending"'))).scalar_one()
    finally:
        await db.dispose()
    assert sum(int(line.split()[2]) for line in printed.splitlines()[1:]) == turns


def test_charts_escape_every_label_and_scale_to_the_largest_value():
    svg = stacked_columns(["2026-12-01", "2026-12-02"], {"<i>p</i>": [10, 30], "q": [0, 10]},
                          "tokens", {"<i>p</i>": ["1 turn(s)", "<b>"]})
    assert "<i>" not in svg and "&lt;i&gt;p&lt;/i&gt;" in svg and "&lt;b&gt;" in svg
    heights = [float(h) for h in re.findall(r'<rect x="[\d.]+" y="[\d.]+" width="[\d.]+" '
                                            r'height="([\d.]+)" fill', svg)]
    assert heights[:3] == pytest.approx([170 * 10 / 40, 170 * 30 / 40, 170 * 10 / 40])
    row = bars([("<b>x</b>", 5, "2 turn(s)"), ("y", 10, "")], "tokens")
    assert "<b>" not in row and "&lt;b&gt;x&lt;/b&gt;: 5 tokens, 2 turn(s)" in row
