"""The dashboard's HTTP routes: the page, its two static files, and the JSON it polls."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse

from cluster.dashboard.state import Dashboard

STATIC = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
"""The only files served besides the page (a fixed list: no path from the URL is opened)."""


def dashboard_router(dashboard: Dashboard) -> APIRouter:
    """``GET /dashboard`` (the page), ``GET /dashboard/{dashboard.js,dashboard.css}`` and
    ``GET /dashboard/data`` (:meth:`Dashboard.data` as JSON, never cached)."""
    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @router.get("/dashboard/data")
    async def data() -> JSONResponse:
        return JSONResponse(await dashboard.data(), headers={"cache-control": "no-store"})

    for name, media_type in ASSETS.items():
        router.add_api_route(f"/dashboard/{name}", _asset(name, media_type),
                             include_in_schema=False)
    return router


def _asset(name: str, media_type: str):
    async def serve() -> FileResponse:
        return FileResponse(STATIC / name, media_type=media_type)
    return serve
