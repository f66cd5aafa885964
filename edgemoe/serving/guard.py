"""What keeps slow or greedy clients from holding the server: connection deadlines and
limits, and a bounded stop.

uvicorn reads a request's headers and body for as long as the client takes, and past
--max-connections answers every request, /health too, with a 503. Here (a subclass of
uvicorn's h11 protocol):

- a connection has `request_timeout_s` to send a request's headers (from the moment it
  opens, or its last response ends) and again `request_timeout_s` for the body; past
  either it is closed;
- a client (one address) holds at most `max_client_connections`, and the server
  `max_connections`; past either limit a new connection closes the oldest connection of
  that client (or of any client) that is part-way through sending a request (else the
  oldest idle one that was never served, and a served client's idle keep-alive one
  last), so connections that trickle bytes cannot keep out one that sends a whole
  request at once (/health); only when every connection is being served is the new one
  refused with a 503.

`stop_within(server, seconds)`: once a stop signal arrives, the process exits after
`seconds` whatever its threads are doing (a worker stuck in a C call cannot be stopped,
and Python would wait for it at exit).
"""

import logging
import os
import threading
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("edgemoe.server")

READING = (h11.IDLE, h11.SEND_BODY)  # the client's side of a request not yet all in
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def guarded_protocol(request_timeout_s: float, max_connections: int,
                     max_client_connections: int):
    """uvicorn's h11 protocol class under the deadlines and limits above."""
    by_client: dict = {}  # client address -> its open connections

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._address = self.client[0] if self.client else "?"
            self._opened = time.monotonic()
            self._phase, self._watch, self._served = None, None, 0
            mine = by_client.setdefault(self._address, set())
            mine.add(self)
            self._watch_phase()
            if len(mine) > max_client_connections:
                self._make_room(mine, f"client {self._address} holds over "
                                      f"{max_client_connections} connections")
            elif len(self.connections) > max_connections:
                self._make_room(self.connections, f"over {max_connections} connections")

        def _make_room(self, pool, why: str):
            readers = [c for c in pool if c is not self and c._reading()]
            if readers:  # part-way through a request first, then idle and never served,
                #          and a client's idle keep-alive connection last
                oldest = min(readers, key=lambda c: (not c._mid_request(), c._served,
                                                     c._since))
                log.info("%s: closed the oldest connection still reading its request "
                            "(%s)", why, oldest._address)
                oldest._close()
                return
            log.warning("%s: refused a connection from %s", why, self._address)
            body = (b'{"error": {"message": "too many connections: every one is being '
                    b'served; try again later", "type": "server_error", "param": null, '
                    b'"code": null}}')
            self.transport.write(_REFUSED % (len(body), body))
            self._close()

        def _reading(self) -> bool:
            return self.conn.their_state in READING

        def _mid_request(self) -> bool:
            """Part of a request in (headers begun, or the body under way)."""
            return self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])

        def _watch_phase(self):
            """Re-arm the deadline when the request moves on (headers in, body in)."""
            phase = (self.conn.their_state, self.cycle)
            if phase == self._phase:
                return
            self._phase, self._since = phase, time.monotonic()
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
            if self._reading() and not self.transport.is_closing():
                self._watch = self.loop.call_later(request_timeout_s, self._expire, phase)

        def _expire(self, phase):
            if phase == self._phase and self._reading():
                what = "body" if self.conn.their_state is h11.SEND_BODY else "headers"
                log.info("%s: closed a connection that took over %g s to send a "
                         "request's %s", self._address, request_timeout_s, what)
                self._close()

        def _close(self):
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes):
            super().data_received(data)
            self._watch_phase()

        def on_response_complete(self):
            self._served += 1
            super().on_response_complete()
            self._watch_phase()

        def connection_lost(self, exc):
            if self._watch is not None:
                self._watch.cancel()
            mine = by_client.get(self._address)
            if mine is not None:
                mine.discard(self)
                if not mine:
                    del by_client[self._address]
            super().connection_lost(exc)

    return Protocol


def stop_within(server, seconds: float):
    """Make `server` (a uvicorn.Server) end the process `seconds` after a stop signal
    if it has not ended by then."""
    handle_exit = server.handle_exit

    def handle(sig, frame):
        if not getattr(server, "_stop_timer", None):
            def exit_now():
                log.error("the server did not stop within %g s of the signal; exiting", seconds)
                logging.shutdown()
                os._exit(1)

            server._stop_timer = threading.Timer(seconds, exit_now)
            server._stop_timer.daemon = True
            server._stop_timer.start()
        handle_exit(sig, frame)

    server.handle_exit = handle
