"""The connection deadlines uvicorn lacks, for `mlx-encoders serve`: uvicorn's h11 protocol with a header timeout
(a request's headers must arrive within `read_timeout` of its first byte, else 408 and the connection closes), an
idle timeout from the moment a connection opens (uvicorn arms its keep-alive timer only after a first answer), and
a shutdown deadline: `shutdown_timeout` seconds after SIGTERM, every connection that is not waiting on a model is
aborted, whether a request is still arriving or an answer is still unread. The body's own deadline is the app's
(`server.read_json`), which answers it in the route's error shape; a body still arriving `BODY_GRACE_S` after that
deadline (one the app answered without reading: 401, 404, 413) closes the connection."""

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADERS_TIMEOUT = b"request headers not received within the server's --read-timeout"
RECHECK_S = 0.1  # after the shutdown deadline, how often a connection still computing is looked at again
BODY_GRACE_S = 1.0  # past the app's own body deadline, so that its 408 goes first


def protocol(read_timeout: float, shutdown_timeout: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these deadlines (seconds); the idle timeout is the
    config's `timeout_keep_alive`."""
    return type("Deadlines", (Deadlines,), {"read_timeout": read_timeout, "shutdown_timeout": shutdown_timeout})


class Deadlines(H11Protocol):
    read_timeout: float
    shutdown_timeout: float
    headers_timer = None
    body_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # a connection that never sends a byte is idle from the start
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc) -> None:
        self.cancel_headers_timer()
        self.cancel_body_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is not h11.IDLE:  # the headers are in: the app reads the body against its deadline
            self.cancel_headers_timer()
            if state is not h11.SEND_BODY:
                self.cancel_body_timer()
            elif self.body_timer is None and not self.transport.is_closing():
                self.body_timer = self.loop.call_later(self.read_timeout + BODY_GRACE_S, self.body_late)
        elif self.headers_timer is None and not self.transport.is_closing():
            self.headers_timer = self.loop.call_later(self.read_timeout, self.headers_late)

    def cancel_body_timer(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def body_late(self) -> None:
        self.body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()  # what was answered is still sent first

    def cancel_headers_timer(self) -> None:
        if self.headers_timer is not None:
            self.headers_timer.cancel()
            self.headers_timer = None

    def headers_late(self) -> None:
        self.headers_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            # h11 answers only a parsed request: the 408 is written by hand, and the connection ends with it
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(HEADERS_TIMEOUT), HEADERS_TIMEOUT)
            )
            self.transport.close()

    def shutdown(self) -> None:
        super().shutdown()  # closes an idle connection now; one with a request closes after its answer
        self.loop.call_later(self.shutdown_timeout, self.shutdown_deadline)

    def shutdown_deadline(self) -> None:
        if self not in self.connections:  # closed already
            return
        cycle = self.cycle
        computing = cycle is not None and not cycle.more_body and not cycle.response_started
        if computing:  # the request arrived whole: its answer is work in flight, finished and sent
            self.loop.call_later(RECHECK_S, self.shutdown_deadline)
        else:  # a request still arriving, or an answer the client does not read
            self.transport.abort()
