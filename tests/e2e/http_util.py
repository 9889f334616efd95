"""Plain urllib HTTP for tests that need exact status codes and raw bodies."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict = field(default_factory=dict)

    def json(self):
        return json.loads(self.body)


def _send(req: urllib.request.Request) -> Reply:
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Reply(r.status, r.read(), dict(r.headers))
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read(), dict(e.headers))


def _auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post(url: str, body, api_key: str | None = None, headers: dict | None = None) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _send(urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                                 **_auth(api_key), **(headers or {})}))


def get(url: str, api_key: str | None = None, headers: dict | None = None) -> Reply:
    return _send(urllib.request.Request(url, headers={**_auth(api_key), **(headers or {})}))
