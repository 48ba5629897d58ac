"""Running the app under uvicorn: in the foreground (``writescope serve``) or in a background
thread on a given socket (tests, benchmarks).

A stop (Ctrl-C, SIGTERM, :meth:`ServerThread.stop`) is graceful: the server takes no new
connections, and the requests in flight may finish for ``GRACEFUL_SHUTDOWN_S`` seconds; those
still running then are failed (:meth:`~writescope.serve.app.ServerState.stop`: HTTP 503, or for a
stream already started an error event, then ``[DONE]``), never answered as if they had finished.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

GRACEFUL_SHUTDOWN_S = 25  # after a stop, requests in flight may finish for this long; those still running then are failed (503);
# the process ends a second or two later (the engine stops, the process exits): 25 keeps it inside a 30 s kill deadline
# (Kubernetes' default terminationGracePeriodSeconds)
CLOSE_MARGIN_S = 10  # uvicorn's own graceful limit is this much longer: the failed requests' answers go out before it would cancel them


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   grace_s: float = GRACEFUL_SHUTDOWN_S) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=grace_s + CLOSE_MARGIN_S, access_log=False)


class Server(uvicorn.Server):
    """uvicorn's server, whose graceful stop gives the requests in flight ``grace_s`` seconds to
    finish, then ends the grace (:meth:`end_grace`): the engine stops and the requests still
    running are failed, so their connections close before uvicorn's own limit (``grace_s`` +
    :data:`CLOSE_MARGIN_S`) would cancel them mid-answer. A second Ctrl-C ends the grace at once.

    Args:
        config: from :func:`uvicorn_config` (with the same ``grace_s``).
        state: the app's :class:`~writescope.serve.app.ServerState`.
        grace_s: seconds the requests in flight may take after a stop.
    """

    def __init__(self, config: uvicorn.Config, state, grace_s: float = GRACEFUL_SHUTDOWN_S):
        super().__init__(config)
        self.ws, self.grace_s = state, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's signal handler (SIGINT, SIGTERM while it serves): the stop begins."""
        super().handle_exit(sig, frame)
        self.ws.closing = True  # a model that finishes loading now is not served
        if self.force_exit and self._loop is not None:  # a second Ctrl-C: no more grace (a loop callback, never inside a route)
            self._loop.call_soon_threadsafe(self.end_grace)

    async def shutdown(self, sockets=None) -> None:
        self.ws.closing = True
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.end_grace)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def end_grace(self) -> None:
        """The requests still running are failed (on the event loop)."""
        self.ws.stop(f"it was still running {self.grace_s:g} s after the server was asked to stop")


class ServerThread:
    """A uvicorn server in a daemon thread, on a loopback socket bound before it starts (so the
    port is known and free: ``port`` 0 picks one).

    Use as a context manager: ``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace_s: float = GRACEFUL_SHUTDOWN_S):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = Server(uvicorn_config(app, host, self.port, log_level, grace_s), app.state.ws, grace_s)
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
        """Graceful stop: requests in flight may finish for ``grace_s``, those still running then
        are failed; the engine is shut down (the app's lifespan)."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
