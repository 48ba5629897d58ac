"""Running the app under uvicorn: in the foreground (``writescope serve``) or in a background
thread on a given socket (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading

import uvicorn

GRACEFUL_SHUTDOWN_S = 30  # in-flight requests may finish for this long after a stop, then are cancelled


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)


class ServerThread:
    """A uvicorn server in a daemon thread, on a loopback socket bound before it starts (so the
    port is known and free: ``port`` 0 picks one).

    Use as a context manager: ``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, host, self.port, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        done = threading.Event()
        while not self.server.started and self.thread.is_alive() and not done.wait(0.01):  # safety-net timeout below
            timeout -= 0.01
            if timeout <= 0:
                raise RuntimeError(f"the server on {self.url} did not start")
        if not self.server.started:
            raise RuntimeError(f"the server on {self.url} exited while starting")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful stop: open requests are cancelled, the engine shut down (the app's lifespan)."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
