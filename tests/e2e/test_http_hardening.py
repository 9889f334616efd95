"""Clients that stop reading their streams, against a real cluster (`pdd up` on
loopback): each is cut after router.http_send_timeout_s and its request aborted
on the worker; the tokens the router holds for a client that does not take
them are bounded (router.max_buffered_tokens)."""
from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

from tests.e2e.cluster import UpCluster
from tests.e2e.test_disagg import metric
from tests.e2e.test_disagg_faults import _wait_for, assert_all_free

STREAMS = 8


def never_reading_stream(cluster: UpCluster, max_tokens: int) -> socket.socket:
    """A chat stream with top-20 logprobs (large chunks fill the buffers between
    us and the router soon) from a client that never reads. Its receive buffer
    and segment size are small, set before connecting: on loopback the router's
    kernel would otherwise queue megabytes for it (a segment of 64 KiB), more
    than a whole answer of the tiny model."""
    body = json.dumps({"model": cluster.model_name, "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 20}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", cluster.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """What the server sent, up to its close (a cut: a reset may come after the data)."""
    sock.settimeout(120)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def security_count(cluster: UpCluster, name: str) -> int:
    return cluster.admin("security").get(name, 0)


@contextlib.contextmanager
def never_reading_clients(run_dir, model, env: dict[str, str]) -> Iterator[tuple[UpCluster, list[socket.socket]]]:
    """A colocated cluster of one worker under `env`, and STREAMS streams of
    3500 tokens on it whose clients never read; at the end the sockets close
    and the cluster stops (cleanly)."""
    with UpCluster(run_dir, model, "--mode", "colocated", "--workers", "1", env=env) as c:
        socks = []
        try:
            socks = [never_reading_stream(c, max_tokens=3500) for _ in range(STREAMS)]
            yield c, socks
        finally:
            for sock in socks:
                sock.close()


def test_clients_that_stop_reading_are_cut_and_their_requests_aborted(tmp_path, tiny_model):
    # The token bound far away: only the send timeout can end these requests early.
    env = {"PDD_ROUTER__HTTP_SEND_TIMEOUT_S": "2", "PDD_ROUTER__MAX_BUFFERED_TOKENS": "100000"}
    with never_reading_clients(tmp_path / "run", tiny_model, env) as (c, socks):
        _wait_for(lambda: security_count(c, "http.send_timeout") >= STREAMS, 300.0,
                  "every never-reading client cut")
        # Aborted on the worker, not finished: every block is free again while
        # the clients still hold their sockets, unread.
        _wait_for(lambda: metric(c, "pdd_requests_total", '{finish_reason="abort",mode="colocated"}') == STREAMS,
                  60.0, "the requests aborted")
        assert_all_free(c)
        for sock in socks:   # cut: what was sent before the cut, then the end of the connection
            assert read_to_end(sock).startswith(b"HTTP/1.1 200")


def test_the_router_holds_a_bounded_number_of_tokens_for_a_client_that_does_not_read(tmp_path, tiny_model):
    # The send timeout far away: only the bound can end these requests early.
    env = {"PDD_ROUTER__HTTP_SEND_TIMEOUT_S": "600", "PDD_ROUTER__MAX_BUFFERED_TOKENS": "64"}
    with never_reading_clients(tmp_path / "run", tiny_model, env) as (c, socks):
        _wait_for(lambda: metric(c, "pdd_requests_rejected_total", '{reason="client_not_reading"}') == STREAMS,
                  300.0, "every never-reading stream's request ended at the bound")
        assert_all_free(c)   # aborted on the worker while the clients still hold their sockets
        assert security_count(c, "http.send_timeout") == 0
        for sock in socks:   # a client that reads at last gets the tokens held for it, then the error
            stream = read_to_end(sock)
            events = [line[6:] for line in map(bytes.strip, stream.split(b"\n")) if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", stream[-300:]
            assert b"did not read its stream" in events[-2], events[-2]
