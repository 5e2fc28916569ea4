"""A small Kubernetes API server emulator over real HTTP (aiohttp), for discovery tests: namespaced list
and watch of any resource, ``resourceVersion`` semantics (a list answers the current version; a watch
sends every event after the version it asks for, then live ones), equality ``labelSelector``\\ s,
compaction (a watch from a compacted version gets the API server's 410 ``ERROR`` event), dropped watches
and restarts on the same port.

kmock (PyPI) was tried first: its emulator serves every list with ``resourceVersion: "..."`` and replays
all objects on each watch, so resuming, 410 and relists cannot be tested with it.

Recorded watch streams are JSON lines (tests/data/k8s/*.jsonl): ``{"type": "ADDED"|"MODIFIED"|"DELETED",
"resource": plural, "object": {...}}``, and ``{"mark": NAME}`` lines that split a recording into steps
(:meth:`KubeEmulator.replay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

DATA = Path(__file__).parent / "data" / "k8s"


def recording(name: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A recording's steps: ``(mark, events before it)``; the last step's mark is ``"end"``."""
    events: list[dict[str, Any]] = []
    for line in (DATA / name).read_text().splitlines():
        if not line.strip():
            continue
        doc = json.loads(line)
        if "mark" in doc:
            yield doc["mark"], events
            events = []
        else:
            events.append(doc)
    yield "end", events


def _matches(selector: str | None, obj: dict[str, Any]) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


class KubeEmulator:
    """The emulator. ``await start()`` binds 127.0.0.1 (a free port, kept across :meth:`restart`).

    Attributes:
        version: the last resourceVersion handed out (an integer counter, as etcd's revision).
        requests: ``(resource, {query})`` of every list and watch request, in order.
    """

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, resource, event)
        self.compacted = 0
        self.version = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.port = 0
        #: the next this many requests are answered 500 (an API server whose etcd is unreachable)
        self.fail_next = 0
        self._watchers: set[asyncio.Queue[tuple[str, dict[str, Any]] | None]] = set()
        self._runner: web.AppRunner | None = None
        self._new = asyncio.Event()

    # -- serving -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen (again) on 127.0.0.1, on the same port after a restart."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/{resource}", self._handle)
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/{resource}", self._handle)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._runner = runner

    async def stop(self) -> None:
        """Stop listening and end every watch (an API server going down)."""
        self.drop_watches()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart(self, down_s: float = 0.3) -> None:
        """Stop, stay down ``down_s`` (clients see connection refused), start on the same port. The
        objects and versions persist (they live in etcd)."""
        await self.stop()
        await asyncio.sleep(down_s)
        await self.start()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig naming this emulator (no credentials) and return its path."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emu", "cluster": {"server": self.url}}],
            "users": [{"name": "emu", "user": {}}],
            "contexts": [
                {"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": "default"}}
            ],
            "current-context": "emu",
        }
        path.write_text(json.dumps(doc))
        return path

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        resource, ns = request.match_info["resource"], request.match_info["ns"]
        query = dict(request.query)
        self.requests.append((resource, query))
        if self.fail_next > 0:
            self.fail_next -= 1
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "code": 500,
                "message": "etcd down",
            }
            return web.json_response(status, status=500)
        selector = query.get("labelSelector")
        if query.get("watch") in ("true", "1"):
            return await self._watch(request, resource, ns, selector, int(query.get("resourceVersion") or 0))
        items = [
            o
            for (r, n, _), o in sorted(self.objects.items())
            if r == resource and n == ns and _matches(selector, o)
        ]
        return web.json_response(
            {
                "kind": "List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(
        self, request: web.Request, resource: str, ns: str, selector: str | None, since: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        if since < self.compacted:
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Expired",
                "code": 410,
                "message": f"too old resource version: {since} ({self.compacted})",
            }
            await send({"type": "ERROR", "object": status})
            return response
        queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            for version, r, event in self.history:
                if version > since and r == resource:
                    await queue.put((r, event))
            while True:
                item = await queue.get()
                if item is None:
                    break
                r, event = item
                obj = event["object"]
                if r == resource and obj["metadata"].get("namespace") == ns and _matches(selector, obj):
                    await send(event)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(queue)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    # -- changing the cluster ------------------------------------------------------------------------
    def apply(self, event: dict[str, Any]) -> None:
        """Apply one recorded event: ADDED/MODIFIED store the object, DELETED removes it; each gets the
        next resourceVersion and goes to every watch."""
        resource, obj = event["resource"], json.loads(json.dumps(event["object"]))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (resource, meta["namespace"], meta["name"])
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        if event["type"] == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        out = {"type": event["type"], "object": obj}
        self.history.append((self.version, resource, out))
        for q in self._watchers:
            q.put_nowait((resource, out))

    def replay(self, name: str, step: str) -> None:
        """Apply the events of one step (the events before the ``{"mark": step}`` line) of a recording."""
        for mark, events in recording(name):
            if mark == step:
                for e in events:
                    self.apply(e)
                return
        raise KeyError(f"{name} has no step {step!r}")

    def compact(self) -> None:
        """Forget the history up to now: a watch from an older version gets 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    def drop_watches(self) -> None:
        """End every open watch stream cleanly (as an API server does at its watch timeout)."""
        for q in list(self._watchers):
            q.put_nowait(None)

    def watch_versions(self, resource: str) -> list[str | None]:
        """The ``resourceVersion`` of every watch request for ``resource``, in order."""
        return [q.get("resourceVersion") for r, q in self.requests if r == resource and q.get("watch")]

    def lists(self, resource: str) -> int:
        """How many list requests ``resource`` got."""
        return sum(1 for r, q in self.requests if r == resource and not q.get("watch"))
