"""Threaded servers on loopback that answer each connection with a scripted handler, for
the data plane's exchanges (``tests/unit/s3/wire/``: ``test_uploads.py``,
``test_uploads_signed.py``, ``test_data_plane.py``)."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Callable

from s3ckpt.config import S3Config
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.loop import io_loop


class ThreadedServer:
    """A server on 127.0.0.1 whose connections run ``handle(sock)`` in a thread each,
    over TLS where a server ``context`` is given."""

    def __init__(
        self, handle: Callable[[socket.socket], None], context: ssl.SSLContext | None = None
    ) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.handle = handle
        self.context = context
        self.accepted = 0
        self.bodies: list[bytes] = []  # the request bodies, where the handler records them
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._one, args=(raw,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _one(self, raw: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if self.context is None:
                with raw:
                    self.handle(raw)
                return
            with self.context.wrap_socket(raw, server_side=True) as sock:
                self.handle(sock)

    def close(self) -> None:
        self.listener.close()
        for thread in self.threads:
            thread.join(timeout=5)


def read_request(
    sock: socket.socket, heads: list[bytes] | None = None, bodies: list[bytes] | None = None
) -> int:
    """Read one request (head and Content-Length body, if any); the body's length, -1 at
    the end. Each head read is appended to ``heads`` where given, each body to ``bodies``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return -1
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if heads is not None:
        heads.append(head)
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,  # a GET or HEAD
    )
    while len(body) < length:
        body += sock.recv(65536)
    if bodies is not None:
        bodies.append(body)
    return length


class ScriptedServers:
    """Servers that answer each request by ``answer(head)`` (``self(answer)``: the server
    and the heads it received), and the clients made for them (:meth:`client`), closed
    by :meth:`close`: the clients first, so the servers' connection threads end at once."""

    def __init__(self) -> None:
        self.servers: list[ThreadedServer] = []
        self.configs: list[S3Config] = []

    def __call__(self, answer: Callable[[bytes], bytes]) -> tuple[ThreadedServer, list[bytes]]:
        """A server answering each request by ``answer(head)``, and the heads it receives
        (its bodies in the server's ``bodies``)."""
        heads: list[bytes] = []

        def handle(sock: socket.socket) -> None:  # runs once a client connects: ``server`` is set
            while read_request(sock, heads, server.bodies) >= 0:
                sock.sendall(answer(heads[-1]))

        server = ThreadedServer(handle)
        self.servers.append(server)
        return server, heads

    def client(self, config: S3Config) -> S3Config:
        """``config``, whose client :meth:`close` closes."""
        self.configs.append(config)
        return config

    def close(self) -> None:
        for config in self.configs:
            io_loop().run(client_handle(config).aclose())
        for server in self.servers:
            server.close()
