"""The chat page served at `GET /` to browsers: three static files in the package (`static/`), no
build step, nothing fetched from elsewhere. The page talks to our own streaming chat API, asking for
the `dspark_step` extension (openai_writer.step_marks) to mark who wrote each token.

Its Content-Security-Policy allows only the page's own script, style and API calls: no inline script,
no other origin, no frames; the script puts model text into the page as text, never as HTML.
"""

from __future__ import annotations

from importlib import resources

PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/static/page.css": ("page.css", "text/css; charset=utf-8"),
}
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def wants_page(accept: str | None) -> bool:
    """A browser navigating to the base URL (it asks for HTML); API clients probing it get the JSON."""
    return accept is not None and "text/html" in accept.lower()


def page_file(path: str) -> tuple[bytes, str]:
    """The bytes and content type of one of PAGE_FILES."""
    name, content_type = PAGE_FILES[path]
    return resources.files("mlx_dspark.serve").joinpath("static", name).read_bytes(), content_type
