"""Where the app changes Chainlit's own behaviour, in one place, each with its reason.
`before_app` runs before the app's routes are added, `after_app` once they are.
"""

from __future__ import annotations

from chat import emits, forget, stalls
from chat.page import serve_own_origin_only
from chat.panel import profile_menu


def before_app(http, sio) -> set[int]:
    """Chainlit mended before anything of the app runs; returns its own routes' ids."""
    # Its Message and Step constructors block the event loop for 1 ms each: not here.
    stalls.skip_constructor_pause()
    # Its page fetches a font and a stylesheet from other origins: not here.
    serve_own_origin_only()
    # It keeps every chat session's messages after the session is gone: not here.
    forget.install()
    # It sends each socket event through a task its sender waits for; one browser's go out
    # in line here.
    emits.install(sio)
    return {id(route) for route in http.router.routes}


def after_app(http, chainlit_routes: set[int], chainlit_config, config) -> None:
    """The app's routes ahead of Chainlit's, and the profile menu the app's own."""
    # Chainlit registered its routes (a catch-all GET among them) before app.py was
    # imported: the app's go first, so that they are reachable and answer in its place.
    http.router.routes.sort(key=lambda route: id(route) in chainlit_routes)
    # Not through @cl.set_chat_profiles: that would wrap the function in a coroutine again.
    chainlit_config.code.set_chat_profiles = profile_menu(config)
