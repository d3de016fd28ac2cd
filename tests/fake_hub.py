"""A fake Hugging Face Hub on loopback, for `llmd pull` (tests never touch the network): it serves
repos of files from memory through the endpoints huggingface_hub uses (the model info with each
file's hashes, and HEAD/GET of ``/{repo}/resolve/{revision}/{file}`` with ranges), and can misbehave
on purpose: cut a file's body short, fail, or serve other bytes than the hashes it lists.

    with FakeHub() as hub:
        hub.add_repo("org/tiny", {"config.json": b"{...}", "model.safetensors": data})
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": ...}
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    served: dict[str, bytes] = field(default_factory=dict)  # what GET sends instead of files[name] (a bad hash)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut: dict[str, int] = {}  # file name -> bytes of its body sent before the connection drops
        self.failing: set[str] = set()  # file names whose GETs answer 500
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_repo(self, repo_id: str, files: dict[str, bytes]) -> Repo:
        self.repos[repo_id] = Repo(files)
        return self.repos[repo_id]

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of file ``name``."""
        return [rng for method, path, rng in self.requests if method == "GET" and path.endswith("/" + name)]

    def info(self, repo_id: str) -> dict[str, Any]:
        repo = self.repos[repo_id]
        siblings = []
        for name, data in repo.files.items():
            entry: dict[str, Any] = {"rfilename": name, "size": len(data),
                                     "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        return {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False, "siblings": siblings}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _send(self, status: int, headers: dict[str, str], body: bytes = b"", send_body: bool = True) -> None:
                headers = dict(headers)
                length = headers.pop("Content-Length", str(len(body)))  # (a HEAD's: the body it would send)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                if send_body and body:
                    self.wfile.write(body)

            def _not_found(self, code: str = "RepoNotFound") -> None:
                body = json.dumps({"error": "Repository not found"}).encode()
                self._send(404, {"X-Error-Code": code, "Content-Type": "application/json"}, body)

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo_id = "/".join(parts[2:4])
                    if repo_id not in hub.repos:
                        return self._not_found()
                    data = json.dumps(hub.info(repo_id)).encode()
                    return self._send(200, {"Content-Type": "application/json"}, data, body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, name = "/".join(parts[:2]), "/".join(parts[4:])
                    repo = hub.repos.get(repo_id)
                    if repo is None:
                        return self._not_found()
                    if name not in repo.files:
                        return self._not_found("EntryNotFound")
                    return self._file(repo, name, body)
                self._not_found()

            def _file(self, repo: Repo, name: str, body: bool) -> None:
                listed = repo.files[name]
                data = repo.served.get(name, listed)
                etag = hashlib.sha256(listed).hexdigest() if name.endswith(LFS_SUFFIXES) else \
                    hashlib.sha1(b"blob %d\0" % len(listed) + listed).hexdigest()
                headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                if name.endswith(LFS_SUFFIXES):
                    headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(listed))}
                if not body:
                    return self._send(200, headers | {"Content-Length": str(len(data))}, b"", False)
                if name in hub.failing and name not in hub.cut:  # (a cut comes first: then the retry fails)
                    return self._send(500, {"Content-Type": "text/plain"}, b"internal error")
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0] or 0)
                status = 206 if start else 200
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                chunk = data[start:]
                cut = hub.cut.pop(name, None)
                if cut is not None:  # announce it all, send part, drop the connection
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(chunk)))
                    self.end_headers()
                    self.wfile.write(chunk[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self._send(status, headers, chunk)

        return Handler
