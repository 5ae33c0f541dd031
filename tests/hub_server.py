"""A local stand-in for the Hugging Face hub, for HF_ENDPOINT: the calls huggingface_hub makes to fetch a
model (model info by revision, the recursive tree listing, HEAD and GET of /resolve/ with ETag,
X-Repo-Commit, Content-Length and Range) with the hub's error headers (X-Error-Code: RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo), private repos that need a token, and faults on demand: a
connection dropped mid-file, a file that stalls mid-way until released, a listed size that lies. Every
request is logged for the tests to check."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_INFO = re.compile(rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?")
_TREE = re.compile(rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?")
_RESOLVE = re.compile(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")


def commit_of(files: dict[str, bytes]) -> str:
    h = hashlib.sha1()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under folder by its repo path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    gated: bool = False
    token: str | None = None  # private: every request needs "Authorization: Bearer TOKEN"

    def add(self, files: dict[str, bytes], *refs: str) -> str:
        sha = commit_of(files)
        self.commits[sha] = dict(files)
        for ref in refs or ("main",):
            self.refs[ref] = sha
        return sha

    def commit(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


class HubServer:
    """Serves repos on 127.0.0.1 from a thread; `with HubServer() as hub:` ... hub.endpoint."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_once: set[str] = set()  # file paths: the next full GET sends half, then drops
        self.stall: set[str] = set()  # file paths: a GET sends half, then waits for `release`
        self.listed_size: dict[str, int] = {}  # file paths: the size the listings give instead of the true one
        self.stalled = threading.Event()  # set when a stalled GET has sent its half
        self.release = threading.Event()
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def repo(self, repo_id: str) -> Repo:
        return self.repos.setdefault(repo_id, Repo())

    def record(self, method: str, path: str, rng: str | None) -> None:
        with self._lock:
            self.log.append((method, path, rng))

    def gets(self, path_suffix: str = "") -> list[tuple[str, str | None]]:
        """(path, Range) of the file GETs whose path ends with path_suffix."""
        with self._lock:
            return [(p, r) for m, p, r in self.log if m == "GET" and "/resolve/" in p and p.endswith(path_suffix)]


def free_port() -> int:
    """A port nothing listens on (for a hub that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-file is one of the tests, not news


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: HubServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, json.dumps({"error": code}).encode(), headers)

    def do_HEAD(self) -> None:
        self._handle()

    def do_GET(self) -> None:
        self._handle()

    def _handle(self) -> None:
        hub = self.server_hub
        path = urlsplit(self.path).path
        hub.record(self.command, path, self.headers.get("Range"))
        for pattern, handler in ((_TREE, self._tree), (_INFO, self._info), (_RESOLVE, self._resolve)):
            m = pattern.fullmatch(path)
            if m:
                repo = hub.repos.get(unquote(m["repo"]))
                if repo is None:
                    return self._error(404, "RepoNotFound")
                if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    return self._error(401, "RepoNotFound")  # the hub does not tell private from missing
                sha = repo.commit(unquote(m["rev"] or "main"))
                if sha is None:
                    return self._error(404, "RevisionNotFound")
                return handler(repo, sha, m)
        self._send(404, b"not found")

    def _info(self, repo: Repo, sha: str, m: re.Match[str]) -> None:
        files = repo.commits[sha]
        doc = {
            "id": unquote(m["repo"]),
            "sha": sha,
            "private": False,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "siblings": [
                {"rfilename": p, "size": self.server_hub.listed_size.get(p, len(b)), "blobId": _etag(b)}
                for p, b in sorted(files.items())
            ],
        }
        self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    def _tree(self, repo: Repo, sha: str, m: re.Match[str]) -> None:
        prefix = unquote(m["path"] or "")
        entries = [
            {"type": "file", "oid": _etag(b), "size": self.server_hub.listed_size.get(p, len(b)), "path": p}
            for p, b in sorted(repo.commits[sha].items())
            if p.startswith(prefix)
        ]
        self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo: Repo, sha: str, m: re.Match[str]) -> None:
        hub = self.server_hub
        if repo.gated:
            return self._error(401, "GatedRepo")
        name = unquote(m["path"])
        data = repo.commits[sha].get(name)
        if data is None:
            return self._error(404, "EntryNotFound", sha)
        headers = {"ETag": f'"{_etag(data)}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        rng = self.headers.get("Range")
        start, status = 0, 200
        if rng and self.command == "GET":
            rm = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
            if rm is None:
                return self._send(416, b"", headers)
            start, end = int(rm[1]), int(rm[2]) if rm[2] else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        if self.command == "GET" and start == 0 and (name in hub.drop_once or name in hub.stall):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            if name in hub.drop_once:
                hub.drop_once.discard(name)
            else:
                hub.stalled.set()
                hub.release.wait(60)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._send(status, data, headers)


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
