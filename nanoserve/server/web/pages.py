"""The browser pages' static files: `GET /` (the chat page) and `GET /static/{name}`; and
`GET /favicon.ico`, which browsers ask every page of a server for, answered 204 (no icon): the
pages declare none, and a 204 ends the browser's request without a 404 in the logs or a binary
asset to keep.

Invariants: only regular files lying directly in `STATIC_DIR` whose suffix has a content type in
`CONTENT_TYPES` are served, looked up by exact name (no path is ever built from the request, so no
traversal); anything else is a 404 in the API's error shape. The files carry no data, so they are
served without the API key; everything the pages fetch goes through the guarded API.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

from nanoserve.server.protocol.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
# The chat page loads only its own files and talks only to its own origin; model output can never
# run script even if a rendering bug let markup through.
CHAT_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                 "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def static_files(directory: Path = STATIC_DIR) -> dict[str, Path]:
    """The servable files of `directory` by name (regular files with a known suffix)."""
    return {p.name: p for p in sorted(directory.iterdir()) if p.is_file() and p.suffix in CONTENT_TYPES}


def static_response(files: dict[str, Path], name: str, headers: dict[str, str] | None = None) -> FileResponse:
    """The file `name` of `files` with its content type, revalidated on every load (`no-cache`:
    an upgraded server never runs an old script); a 404 if there is no such file."""
    path = files.get(name)
    if path is None:
        raise APIError(404, f"no static file {name!r}", code="not_found")
    return FileResponse(path, media_type=CONTENT_TYPES[path.suffix],
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", **(headers or {})})


def register_pages(app: FastAPI) -> None:
    """Adds `GET /` (chat.html), `GET /favicon.ico` and `GET /static/{name}` to `app`; the file
    list is read once."""
    files = static_files()

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return static_response(files, "chat.html", {"Content-Security-Policy": CHAT_PAGE_CSP})

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        return static_response(files, name)
