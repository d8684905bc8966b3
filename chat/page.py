"""Chainlit's page as this app serves it: nothing from other origins. Chainlit 2.12's
index.html links a web font from Google's servers and KaTeX's stylesheet from a public CDN
(and opens connections to both ahead of time): offline those requests fail, online each
visit is told to third parties. The font falls back to the browser's own sans-serif, and
KaTeX's stylesheet is not needed (LaTeX rendering is off in .chainlit/config.toml)."""

from __future__ import annotations

import re

_OFF_ORIGIN = re.compile(
    r"<link\b[^>]*?https://(?:fonts\.googleapis\.com|fonts\.gstatic\.com|cdn\.jsdelivr\.net)"
    r"[^>]*>\s*")


def own_origin_only(html: str) -> str:
    """The page without its links to other origins."""
    return _OFF_ORIGIN.sub("", html)


def serve_own_origin_only() -> None:
    """Every page Chainlit serves from now on goes through `own_origin_only`."""
    import chainlit.server as server

    original = server.get_html_template
    if getattr(original, "own_origin_only", False):
        return
    server.get_html_template = lambda root_path: own_origin_only(original(root_path))
    server.get_html_template.own_origin_only = True
