"""The web console the gateway serves: `/` a chat playground, `/cluster` a live view of the cluster.

Plain static files (services/gateway/static/: HTML, CSS, hand-written JS; no build step, no CDN:
clusters often have no internet) and one JSON endpoint, `GET /api/cluster`, the scheduler's
stats as `zeroserve status --json` shows them plus the gateway's clock. The page polls it and
takes rates (tokens/s, steps/s, TTFT) as differences between two polls, so the scheduler keeps
only totals and any number of open pages cost it one stats request each per poll.

The pages are public (they hold no data); what they fetch, /v1/* and /api/*, is behind the
gateway's --api-key (app.py's Outer): the page asks for the key and sends it as a Bearer token.
Every page carries a strict Content-Security-Policy: scripts and styles from this origin only,
no inline code, no framing, requests to this origin only.
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from zeroserve.common.errors import ZeroserveError
from zeroserve.services.gateway.errors import api_error

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
PAGES = {"/": "chat.html", "/cluster": "cluster.html"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
PATHS = {*PAGES, "/api/cluster"}  # for the gateway's request counter labels


def _load_static() -> dict[str, tuple[bytes, str]]:
    """Every static file, read once (tens of kB): name -> (bytes, content type). Only these
    names are ever served, so no request path reaches the file system."""
    out = {}
    for f in resources.files("zeroserve.services.gateway").joinpath("static").iterdir():
        ext = f.name[f.name.rfind("."):]
        if f.is_file() and ext in TYPES:
            out[f.name] = (f.read_bytes(), TYPES[ext])
    return out


def add_console(app: FastAPI, gw) -> None:
    """Register the console's routes on the gateway's FastAPI app."""
    files = _load_static()

    def serve(name: str) -> Response:
        body, ctype = files[name]
        return Response(body, media_type=ctype, headers=SECURITY_HEADERS)

    for path, name in PAGES.items():
        app.add_api_route(path, lambda name=name: serve(name), methods=["GET"], include_in_schema=False)

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in files:
            return JSONResponse({"error": {"message": f"no static file {name!r}", "type": "NotFoundError"}},
                                status_code=404)
        return serve(name)

    @app.get("/api/cluster", include_in_schema=False)
    async def cluster():
        try:
            stats = await gw.client.stats()
        except ZeroserveError as e:  # the scheduler is away: the page says so and keeps polling
            return api_error(e).response()
        return JSONResponse({"time": time.time(), "stats": stats}, headers={"Cache-Control": "no-store"})


__all__ = ["CSP", "PATHS", "add_console"]
