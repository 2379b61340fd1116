"""A TCP relay on 127.0.0.1 in front of a real S3 server that can stop taking bytes, as a
store that filled up and hangs does (Ceph RGW on a full cluster): connections are still
accepted, but nothing more is read from them and nothing is answered.

Bytes are relayed untouched (HTTP and TLS alike) until :meth:`StallingProxy.stall` is
called, or until ``stall_after`` bytes of requests have gone through (the first large
request body, not the small requests before it). While stalled, every connection, open
or new, reads nothing: a client's sends fill the socket buffers and then block, and no
answer comes. :meth:`resume` lets bytes through again (connections the client gave up
on meanwhile are closed by it). Used by ``tests/integration/test_stalled_store.py`` and
its worker; ``relayed`` counts the request bytes that went through.
"""

from __future__ import annotations

import contextlib
import socket
import threading

_CHUNK = 64 * 1024
_POLL_S = 0.05


class StallingProxy:
    """Relays 127.0.0.1:``port`` to ``upstream`` (host, port) until told to stall."""

    def __init__(self, upstream: tuple[str, int], *, stall_after: int | None = None) -> None:
        self.upstream = upstream
        self.stall_after = stall_after
        self.relayed = 0  # request bytes relayed to the server
        self.accepted = 0
        self._stalled = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True, name="stalling-proxy").start()

    @property
    def stalled(self) -> bool:
        return self._stalled.is_set()

    def endpoint_url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def stall(self) -> None:
        """Stop taking bytes: nothing more is read from any connection, none is answered."""
        self._stalled.set()

    def resume(self, *, stall_after: int | None = None) -> None:
        """Relay bytes again (until ``stall_after`` more request bytes, where given)."""
        with self._lock:
            self.stall_after = None if stall_after is None else self.relayed + stall_after
        self._stalled.clear()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> StallingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            for source, sink, counted in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._pump, args=(source, sink, counted), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        source.settimeout(_POLL_S)
        try:
            while not self._closed.is_set():
                if self._stalled.is_set():
                    self._stalled_wait()
                    continue
                try:
                    data = source.recv(self._room() if counted else _CHUNK)
                except TimeoutError:
                    continue
                if not data:
                    break
                sink.sendall(data)
                if counted:
                    self._count(len(data))
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _stalled_wait(self) -> None:
        self._closed.wait(_POLL_S)

    def _room(self) -> int:
        """How many request bytes may be read before the stall begins."""
        with self._lock:
            limit = self.stall_after
            return _CHUNK if limit is None else max(1, min(_CHUNK, limit - self.relayed))

    def _count(self, size: int) -> None:
        with self._lock:
            self.relayed += size
            if self.stall_after is not None and self.relayed >= self.stall_after:
                self._stalled.set()
