"""The browser console: static pages that use the public API (and the admin API), served by the blueprint."""

from pathlib import Path

from flask import Blueprint, redirect, request, send_from_directory
from ..protocol import Protocol

bp = Blueprint("console", __name__)
PROTOCOL = Protocol("console", bp, prefixes=("/console",), needs_key=False)  # it asks for a key itself

PAGES = Path(__file__).resolve().parents[2] / "console"


@bp.get("/console")
def console():
    """The console's page (its links are relative: it needs the trailing slash)."""
    return redirect(request.path + "/", code=308)


@bp.get("/console/")
@bp.get("/console/<path:name>")
def page(name: str = "index.html"):
    """A file of the console; nothing outside its directory."""
    response = send_from_directory(PAGES, name, max_age=0)
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; script-src 'self'; connect-src 'self'; "
        "frame-ancestors 'none'")  # no other site may frame it (a click on its unload button)
    return response
