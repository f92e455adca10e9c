"""The dashboard's web server: the page (static files shipped in toolkit/ui/static), the JSON API under /api/ that
the page itself uses (docs/ui.md), and the run folders' files (samples, report.html).

Python's own `http.server` (threads, one per request) serves it: the dashboard has a handful of users on one
machine and a few small JSON answers a second, which needs no framework and no dependency.

Safety: with a token (required to bind anything but a loopback address) every request without it gets 401; it
comes as `Authorization: Bearer T`, the `difftune_token` cookie, or `?token=T` (which sets the cookie). On a
loopback address the Host header must name it (a web page elsewhere cannot reach the dashboard through DNS
rebinding), and every POST and DELETE needs the `X-Difftune: 1` header (a form or script on another site cannot
send it without the browser asking first, which this server never allows). Files are served only from inside run
folders and the static folder (anything else, `..` included, is 404).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import mimetypes
import os
import re
import secrets
import socket
import threading
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from toolkit.run import control
from toolkit.ui.jobs import JobQueue
from toolkit.ui.runs import RunReader, UnknownRun, inside, run_folder

log = logging.getLogger("difftune")

STATIC = Path(__file__).resolve().parent / "static"
TOKEN_COOKIE = "difftune_token"
#: the header every changing request carries (see the module's docstring)
WRITE_HEADER = "X-Difftune"
MAX_BODY = 1 << 20
PAGE_POLICY = ("default-src 'self'; img-src 'self' data: blob:; media-src 'self' data: blob:; "
               "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'")
#: every file of a run folder is served sandboxed: report.html's scripts run, but no file of a run folder (whatever its
#: type) acts as the dashboard's origin
RUN_FILE_POLICY = "sandbox allow-scripts; default-src 'self' data: 'unsafe-inline'"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str, **extra):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class Dashboard(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, queue: JobQueue | None, host: str = "127.0.0.1", port: int = 8675,
                 token: str | None = None):
        if not is_loopback(host) and not token:
            raise ValueError("a dashboard on a non-loopback address needs a token")
        if token is not None and not TOKEN_PATTERN.match(token):
            raise ValueError("a token is at least 16 characters of A-Z, a-z, 0-9, '.', '_', '~' and '-'")
        self.root = root.resolve()
        self.reader = RunReader(self.root)
        self.queue = queue
        self.token = token
        #: the queue's runner, when this dashboard has one (`queue_running` says whether it runs the queue now)
        self.runner = None
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler)
        self.loopback = is_loopback(host)

    @property
    def queue_running(self) -> bool:
        return self.runner is not None and self.runner.holding

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="difftune-ui", daemon=True)
        thread.start()
        return thread


class Handler(BaseHTTPRequestHandler):
    server: Dashboard
    protocol_version = "HTTP/1.1"
    #: an idle kept-alive connection is closed after this many seconds (it holds a thread)
    timeout = 60

    # ---- plumbing ----------------------------------------------------------------------------------------

    def log_message(self, format: str, *args) -> None:
        log.debug("ui %s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_DELETE(self) -> None:
        self.dispatch("DELETE")

    def dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        self.answered = False  # whether an answer's headers went out (after that, a failure can only close)
        if method != "GET" or self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") != "0":
            # a request with a body ends its connection: whatever of the body is not read (a refused request's) can
            # never be taken for a next request on the same connection
            self.close_connection = True
        try:
            if not self.host_allowed():
                raise ApiError(HTTPStatus.MISDIRECTED_REQUEST, "this dashboard answers on its own address only")
            set_cookie = self.check_token(query)
            if method != "GET" and self.headers.get(WRITE_HEADER) != "1":
                raise ApiError(HTTPStatus.FORBIDDEN, f"a {method} request needs the header {WRITE_HEADER}: 1")
            self.route(method, parts, query, set_cookie)
        except ApiError as err:
            if self.answered:
                self.close_connection = True
                return
            self.send_json({"error": err.message, **err.extra}, err.status)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as err:  # a bug answers 500 with its name, and the server goes on
            log.exception("ui: %s %s", method, self.path)
            if self.answered:
                self.close_connection = True
                return
            self.send_json({"error": f"{type(err).__name__}: {err}"}, HTTPStatus.INTERNAL_SERVER_ERROR)

    def host_allowed(self) -> bool:
        if not self.server.loopback:
            return True
        host = self.headers.get("Host") or ""
        name = host[: host.find("]") + 1] if host.startswith("[") else host.rsplit(":", 1)[0]
        return is_loopback(name)

    def check_token(self, query: dict) -> bool:
        """Raises 401 without the token; True when it came in the query (the answer sets the cookie)."""
        token = self.server.token
        if not token:
            return False
        given = self.headers.get("Authorization", "")
        if given.startswith("Bearer ") and same_token(given[7:].strip(), token):
            return False
        if same_token(cookie_value(self.headers.get("Cookie", ""), self.cookie_name), token):
            return False
        if same_token(query.get("token", [""])[0], token):
            return True
        raise ApiError(HTTPStatus.UNAUTHORIZED, "this dashboard needs its token (open the address it printed, "
                       "or send Authorization: Bearer TOKEN)")

    @property
    def cookie_name(self) -> str:
        """The token's cookie, named per port: browsers share cookies across the ports of one host."""
        return f"{TOKEN_COOKIE}_{self.server.server_address[1]}"

    def send_json(self, data, status: HTTPStatus = HTTPStatus.OK) -> None:
        body = json.dumps(data).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_common_headers()
        self.end_headers()
        self.answered = True
        self.wfile.write(body)

    def send_common_headers(self, policy: str = PAGE_POLICY) -> None:
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", policy)
        self.send_header("Referrer-Policy", "no-referrer")

    def send_file(self, path: Path, set_cookie: bool = False, policy: str = PAGE_POLICY) -> None:
        """The file as it is when opened: exactly the bytes its size says then (a file that grows meanwhile, e.g.
        metrics.jsonl, sends what it had). One byte range (`Range: bytes=A-B`, `A-`, `-N`) is answered with 206, as
        players ask for videos (Safari plays an mp4 only so)."""
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind in ("application/javascript", "application/json"):
            kind += "; charset=utf-8"
        try:
            handle = path.open("rb")
        except OSError as err:
            raise ApiError(HTTPStatus.NOT_FOUND, "no such file") from err
        with handle:
            size = os.fstat(handle.fileno()).st_size
            wanted = self.headers.get("Range")
            chosen = (0, size - 1) if wanted is None else byte_range(wanted, size)
            if chosen is None:
                raise ApiError(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, f"no such byte range of {size} bytes: "
                               f"{wanted}")
            first, last = chosen
            partial = wanted is not None and (first, last) != (0, size - 1)
            self.send_response(HTTPStatus.PARTIAL_CONTENT if partial else HTTPStatus.OK)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(last - first + 1))
            self.send_header("Accept-Ranges", "bytes")
            if partial:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Cache-Control", "no-cache")
            if set_cookie:
                self.send_header("Set-Cookie", f"{self.cookie_name}={self.server.token}; HttpOnly; SameSite=Strict; "
                                 "Path=/")
            self.send_common_headers(policy)
            self.end_headers()
            self.answered = True
            handle.seek(first)
            left = last - first + 1
            while left > 0:
                chunk = handle.read(min(left, 1 << 20))
                if not chunk:  # the file shrank: the client sees a short answer, the connection ends
                    self.close_connection = True
                    break
                self.wfile.write(chunk)
                left -= len(chunk)

    def body(self) -> str:
        if self.headers.get("Transfer-Encoding"):
            raise ApiError(HTTPStatus.NOT_IMPLEMENTED, "send the body with a Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from err
        if length < 0:
            raise ApiError(HTTPStatus.BAD_REQUEST, "Content-Length is negative")
        if length > MAX_BODY:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a request body is at most {MAX_BODY} bytes")
        try:
            return self.rfile.read(length).decode("utf-8")
        except UnicodeDecodeError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the body is not UTF-8 text: {err}") from err

    # ---- routes ------------------------------------------------------------------------------------------

    def route(self, method: str, parts: list[str], query: dict, set_cookie: bool) -> None:
        match (method, parts):
            case ("GET", [""] | ["index.html"]):
                self.send_file(STATIC / "index.html", set_cookie)
            case ("GET", ["static", name]):
                path = inside(STATIC, name)
                if path is None:
                    raise ApiError(HTTPStatus.NOT_FOUND, "no such file")
                self.send_file(path, set_cookie)
            case ("GET", ["runs", name, "files", *relative]) if relative:
                self.run_file(name, "/".join(relative))
            case ("GET", ["api", "runs"]):
                self.send_json({"training_folder": str(self.server.root),
                                "runs": [self.summary(n) for n in self.server.reader.names()]})
            case ("GET", ["api", "runs", name]):
                since = query.get("since", [None])[0]
                try:
                    detail = self.server.reader.detail(name, None if since in (None, "") else int(since))
                except ValueError as err:
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"since: {err}") from err
                except UnknownRun as err:
                    raise ApiError(HTTPStatus.NOT_FOUND, f"no run {name!r}") from err
                self.send_json(detail)
            case ("POST", ["api", "runs", name, "control", action]):
                self.control(name, action)
            case ("GET", ["api", "jobs"]):
                queue = self.need_queue()
                self.send_json({"jobs": [asdict(job) for job in queue.jobs()], "runner": self.server.queue_running,
                                "gpu_sets": queue.gpu_sets})
            case ("POST", ["api", "jobs"]):
                self.submit(query)
            case ("GET", ["api", "jobs", job_id]):
                job = self.need_queue().job(job_id)
                if job is None:
                    raise ApiError(HTTPStatus.NOT_FOUND, f"no job {job_id!r}")
                self.send_json({**asdict(job), "log": self.server.queue.log_tail(job)})
            case ("DELETE", ["api", "jobs", job_id]):
                queue = self.need_queue()
                if not self.server.queue_running:
                    raise ApiError(HTTPStatus.CONFLICT, "another dashboard runs this queue: cancel the job there")
                try:
                    job = queue.cancel(job_id)
                except KeyError as err:
                    raise ApiError(HTTPStatus.NOT_FOUND, f"no job {job_id!r}") from err
                except ValueError as err:
                    raise ApiError(HTTPStatus.CONFLICT, str(err)) from err
                self.send_json(asdict(job))
            case _:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no {method} {urlsplit(self.path).path}")

    def summary(self, name: str) -> dict:
        """One run's row; a run folder that cannot be read (removed meanwhile, unreadable, a hand-edited file) is
        listed as unknown with the reason, never the end of the list."""
        try:
            return self.server.reader.summary(name)
        except UnknownRun:
            return {"name": name, "state": "unknown", "note": "no longer a run folder"}
        except Exception as err:  # noqa: BLE001
            return {"name": name, "state": "unknown", "note": f"cannot read it: {type(err).__name__}: {err}"}

    def run_file(self, name: str, relative: str) -> None:
        try:
            folder = run_folder(self.server.root, name)
        except UnknownRun as err:
            raise ApiError(HTTPStatus.NOT_FOUND, "no such file") from err
        path = inside(folder, relative)
        if path is None:
            raise ApiError(HTTPStatus.NOT_FOUND, "no such file")
        self.send_file(path, policy=RUN_FILE_POLICY)

    def control(self, name: str, action: str) -> None:
        try:
            folder = run_folder(self.server.root, name)
        except UnknownRun as err:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no run {name!r}") from err
        if action not in control.ACTIONS:
            raise ApiError(HTTPStatus.NOT_FOUND, f"unknown control action {action!r} (one of: "
                           f"{', '.join(control.ACTIONS)})")
        try:
            path = control.request(folder, action)
        except ValueError as err:  # not running
            raise ApiError(HTTPStatus.CONFLICT, str(err)) from err
        self.send_json({"requested": action, "request": path.name}, HTTPStatus.ACCEPTED)

    def need_queue(self) -> JobQueue:
        if self.server.queue is None:
            raise ApiError(HTTPStatus.NOT_FOUND, "this dashboard has no job queue")
        return self.server.queue

    def submit(self, query: dict) -> None:
        queue = self.need_queue()
        text = self.body()
        given = Path(query.get("filename", ["job.yaml"])[0]).name or "job.yaml"
        job, problems = queue.submit(text, given)
        if problems:
            self.send_json({"errors": problems}, HTTPStatus.BAD_REQUEST)
            return
        self.send_json({"job": asdict(job)}, HTTPStatus.CREATED)


#: what a token may hold: it travels in a header, a cookie and an address
TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9._~-]{16,}$")


def new_token() -> str:
    return secrets.token_urlsafe(24)


def byte_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) byte that a `Range` header asks of a file of `size` bytes, None when nothing it asks for exists
    (416). A header this server does not take (another unit, several ranges, malformed) asks for the whole file, as
    HTTP lets a server answer it."""
    whole = (0, size - 1)
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if match is None or match.groups() == ("", ""):
        return whole
    start, end = match.groups()
    if not start:  # the last N bytes
        count = int(end)
        return (max(size - count, 0), size - 1) if count and size else None
    first = int(start)
    last = min(int(end), size - 1) if end else size - 1
    if end and int(end) < first:
        return whole  # malformed
    return (first, last) if first < size else None


def same_token(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode("utf-8"))


def cookie_value(header: str, name: str) -> str:
    """A cookie's value, read by hand: one unreadable cookie of another application on this host must not hide
    it (http.cookies stops at the first one it cannot parse)."""
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value.strip().strip('"')
    return ""
