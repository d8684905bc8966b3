// The Export menu in the page's header: the chat open from the sidebar (its address is
// /thread/ID) or every chat of the logged-in user, as Markdown or JSON, downloaded from
// chat/downloads.py's routes with the page's own login cookie; share links; for an admin,
// the admin page. It lives outside Chainlit's
// React tree and puts itself back whenever the header is drawn anew.
(function () {
  const root = document.querySelector('meta[property="og:root_path"]')?.content || "";
  const STYLE = "font:14px/1.4 sans-serif;";

  function openChat() {
    const found = location.pathname.match(/\/thread\/([0-9a-f-]{36})/);
    return found ? found[1] : null;
  }

  function link(text, path) {
    const a = document.createElement("a");
    a.textContent = text;
    a.href = root + path;
    a.setAttribute("download", "");
    a.style.cssText = STYLE + "display:block;padding:6px 12px;color:inherit;" +
      "text-decoration:none;white-space:nowrap";
    a.addEventListener("click", close);
    return a;
  }

  // "Share this chat": a read-only link to the chat as it is now (chat/shares.py), shown
  // in the menu to copy; what the server refuses is said there in its words.
  function shareItem(chat) {
    const item = link("Share this chat (a link)", "#");
    item.removeAttribute("download");
    item.id = "share-chat";
    item.removeEventListener("click", close);
    item.addEventListener("click", async (event) => {
      event.preventDefault();
      event.stopPropagation();
      const answer = await fetch(`${root}/share/chats/${chat}`, {
        method: "POST", credentials: "same-origin", headers: {"Accept": "application/json"}});
      const body = await answer.json().catch(() => ({}));
      const shown = document.createElement("div");
      shown.style.cssText = STYLE + "padding:6px 12px;max-width:22rem";
      if (answer.ok) {
        const field = document.createElement("input");
        field.id = "share-link";
        field.readOnly = true;
        field.value = body.url;
        field.style.cssText = STYLE + "width:100%;box-sizing:border-box";
        shown.append("A link to this chat as it is now:", field);
        item.replaceWith(shown);
        field.select();
        navigator.clipboard?.writeText(body.url).catch(() => {});
      } else {
        shown.id = "share-refused";
        shown.textContent = body.detail || "This chat could not be shared.";
        item.replaceWith(shown);
      }
    });
    return item;
  }

  // A GET of this site's with the page's login, as JSON; null if it did not answer so.
  async function getJson(path) {
    const answer = await fetch(root + path, {credentials: "same-origin"}).catch(() => null);
    return answer && answer.ok ? answer.json().catch(() => null) : null;
  }

  function close() {
    document.getElementById("export-menu")?.remove();
  }

  function toggle(button) {
    if (document.getElementById("export-menu")) return close();
    const menu = document.createElement("div");
    menu.id = "export-menu";
    menu.setAttribute("role", "menu");
    const box = button.getBoundingClientRect();
    menu.style.cssText = STYLE + `position:fixed;top:${box.bottom + 4}px;` +
      `right:${Math.max(8, innerWidth - box.right)}px;z-index:1001;padding:4px 0;` +
      "border-radius:8px;border:1px solid rgba(128,128,128,.35);" +
      "background:hsl(var(--background, 0 0% 100%));color:hsl(var(--foreground, 0 0% 7%));" +
      "box-shadow:0 2px 8px rgba(0,0,0,.15)";
    const chat = openChat();
    if (chat) {
      menu.append(link("This chat as Markdown", `/export/chats/${chat}?format=md`),
                  link("This chat as JSON", `/export/chats/${chat}?format=json`));
    }
    menu.append(link("All my chats as Markdown", "/export/chats?format=md"),
                link("All my chats as JSON", "/export/chats?format=json"));
    document.body.appendChild(menu);
    shareItems(menu, chat).then(() => adminItem(menu));  // in this order
  }

  // Share links, where this user may make them (chat/shares.py: none with sharing off,
  // none for a demo's guests unless the operator allows it).
  async function shareItems(menu, chat) {
    const allowed = await getJson("/share/allowed");
    if (!allowed?.share || !menu.isConnected) return;
    const links = link("My share links", "/share");
    links.removeAttribute("download");
    links.id = "share-links";
    menu.append(...(chat ? [shareItem(chat)] : []), links);
  }

  // For an admin, the admin page (chat/admin.py; it checks the role itself).
  async function adminItem(menu) {
    const user = await getJson("/user");
    if (user?.metadata?.role !== "admin" || !menu.isConnected) return;
    const admin = link("Admin page", "/admin");
    admin.removeAttribute("download");
    admin.id = "admin-page";
    menu.append(admin);
  }

  function place() {
    const anchor = document.getElementById("theme-toggle");
    if (!anchor || document.getElementById("export-button")) return;
    const button = document.createElement("button");
    button.id = "export-button";
    button.type = "button";
    button.textContent = "Export";
    button.title = "Download chats as Markdown or JSON";
    button.style.cssText = STYLE + "padding:4px 10px;margin-right:4px;border-radius:6px;" +
      "border:1px solid rgba(128,128,128,.35);background:transparent;color:inherit;" +
      "cursor:pointer";
    button.addEventListener("click", (event) => {
      event.stopPropagation();
      toggle(button);
    });
    anchor.parentElement.insertBefore(button, anchor);
  }

  document.addEventListener("click", (event) => {
    if (!event.target.closest?.("#export-menu")) close();
  });
  new MutationObserver(place).observe(document.body, {childList: true, subtree: true});
  place();
})();
