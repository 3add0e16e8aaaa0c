"""A TCP server on 127.0.0.1 that accepts connections and never answers: the collector that is
there but hung, for the exit-time tests."""

from __future__ import annotations

import socket
import threading
from typing import List


class BlackHole:
    """Accepts every connection, reads and discards what arrives, never writes a byte."""

    def __init__(self) -> None:
        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._conns: List[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="blackhole", daemon=True)

    def _serve(self) -> None:
        self._srv.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                continue
            self.accepted += 1
            self._conns.append(conn)  # kept open, never read back: the peer waits forever

    def __enter__(self) -> "BlackHole":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self._conns:
            c.close()
        self._srv.close()


if __name__ == "__main__":  # a subprocess's black hole: prints the port, serves until killed
    import sys
    import time

    with BlackHole() as bh:
        print(bh.port, flush=True)
        sys.stdout.close()
        while True:
            time.sleep(3600)
