// A line at the top of the page while the model is not ready (starting, restarting,
// failed, shutting down), gone once it is, but for what always holds (a test mode, a
// demo's banner). It lives outside Chainlit's React tree: a chat message for this switched
// Chainlit's view under the input and lost what the user was typing. The words come from
// the server (/notice, chat/view.py page_line).
(function () {
  const root = document.querySelector('meta[property="og:root_path"]')?.content || "";
  const UNTIL_READY_MS = 2000, WHILE_READY_MS = 15000;

  // The line covers the chat's top: the reader may close it, and it stays closed in this
  // tab until it says something else (the model restarting, say).
  const CLOSED = "vchat-notice-closed";

  function show(text) {
    if (sessionStorage.getItem(CLOSED) === text) return hide();
    let line = document.getElementById("model-status");
    if (!line) {
      line = document.createElement("div");
      line.id = "model-status";
      line.setAttribute("role", "status");
      line.style.cssText = "position:fixed;top:64px;left:50%;transform:translateX(-50%);" +
        "z-index:1000;max-width:min(720px,90vw);padding:8px 36px 8px 16px;border-radius:8px;" +
        "background:#fff7e0;color:#4a3b00;border:1px solid #e8d48a;font:14px/1.4 sans-serif;" +
        "box-shadow:0 2px 8px rgba(0,0,0,.12)";
      line.appendChild(document.createElement("span"));
      const close = document.createElement("button");
      close.id = "model-status-close";
      close.type = "button";
      close.setAttribute("aria-label", "Close this notice");
      close.title = "Close";
      // The cross drawn, not written: the line's text is the notice's words alone.
      close.style.cssText = "position:absolute;top:6px;right:8px;width:22px;height:22px;" +
        "border:0;background:none;cursor:pointer;color:inherit;opacity:.7;" +
        "background-image:linear-gradient(45deg,transparent 45%,currentColor 45%," +
        "currentColor 55%,transparent 55%),linear-gradient(-45deg,transparent 45%," +
        "currentColor 45%,currentColor 55%,transparent 55%);background-size:12px 12px;" +
        "background-repeat:no-repeat;background-position:center";
      close.addEventListener("click", () => {
        sessionStorage.setItem(CLOSED, line.firstChild.textContent);
        hide();
      });
      line.appendChild(close);
      document.body.appendChild(line);
    }
    line.firstChild.textContent = text;
  }

  function hide() {
    document.getElementById("model-status")?.remove();
  }

  async function check() {
    let ready = false;
    try {
      const answer = await (await fetch(root + "/notice", {cache: "no-store"})).json();
      ready = answer.ready;
      answer.notice ? show(answer.notice) : hide();
    } catch (unreachable) {
      // The server is away: Chainlit's page says so itself; try again later.
    }
    setTimeout(check, ready ? WHILE_READY_MS : UNTIL_READY_MS);
  }

  check();

  // The page takes one custom script (.chainlit/config.toml): the Export menu comes here.
  const menu = document.createElement("script");
  menu.src = root + "/public/export-menu.js";
  document.head.appendChild(menu);
})();
