"""A Hugging Face hub on 127.0.0.1 for tests: `python fake_hub.py PORT SPEC.json` serves the folders SPEC names,
{"org/name": {"main": [sha, folder], ...}}, through the routes huggingface_hub's snapshot_download calls (repo
info, tree listing, file resolve) until it is killed."""

import hashlib
import json
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPOS = json.loads(Path(sys.argv[2]).read_text())


def files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def find(repo: str, revision: str) -> tuple[str | None, Path | None]:
    for name, (sha, folder) in REPOS.get(repo, {}).items():
        if revision in (name, sha):
            return sha, Path(folder)
    return None, None


class Hub(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, code: int, body: bytes, headers: dict, head: bool) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def route(self, head: bool) -> None:
        parts = urllib.parse.unquote(urllib.parse.urlparse(self.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"]:  # api/models/ORG/NAME/(revision|tree)/REV
            sha, folder = find("/".join(parts[2:4]), "/".join(parts[5:]) or "main")
            if sha is None:
                return self.answer(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
            if parts[4] == "revision":
                body = {"id": "/".join(parts[2:4]), "sha": sha, "siblings": [{"rfilename": f} for f in files(folder)]}
            else:
                body = [
                    {"type": "file", "path": f, "size": (folder / f).stat().st_size,
                     "oid": hashlib.sha1((folder / f).read_bytes()).hexdigest()}
                    for f in files(folder)
                ]  # fmt: skip
            return self.answer(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        if "resolve" in parts:  # ORG/NAME/resolve/REV/FILE
            i = parts.index("resolve")
            sha, folder = find("/".join(parts[:i]), parts[i + 1])
            file = folder / "/".join(parts[i + 2 :]) if folder else None
            if file is None or not file.is_file():
                return self.answer(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
            data = file.read_bytes()
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            return self.answer(200, data, {"X-Repo-Commit": sha, "ETag": etag}, head)
        self.answer(404, b"", {}, head)

    def do_GET(self):
        self.route(False)

    def do_HEAD(self):
        self.route(True)


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Hub).serve_forever()
