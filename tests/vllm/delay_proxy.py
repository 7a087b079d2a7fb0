"""A TCP proxy that delays everything the server sends by a fixed time (a far metadata
service), for the tests of lookups that must not block vLLM's scheduler. Runs in the test."""

from __future__ import annotations

import socket
import threading
import time


class DelayProxy:
    """Forwards every connection to `target`; server-to-client bytes wait `delay_s` each read."""

    def __init__(self, target: str, delay_s: float) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.delay_s = (host, int(port)), delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(server, client, self.delay_s), daemon=True
            ).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        try:
            while data := source.recv(1 << 16):
                time.sleep(delay_s)
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # either side went away
            pass
        finally:
            source.close()

    def close(self) -> None:
        self.listener.close()
