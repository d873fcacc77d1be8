"""The raw asyncio/httptools server (`server: raw`) speaks HTTP/1.1 as uvicorn does, over
real loopback sockets: keep-alive and pipelined requests answered in order, bodies framed
by Content-Length or chunked, HEAD without a body, `Expect: 100-continue`, a body read as
it arrives, a 500 that closes the connection when the app fails, and the app's lifespan
around it all. (Every HTTP test of the app also runs under it: the `live` fixture.)"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any

import httpx
import pytest

from tests.live import LiveServer
from tests.unit.conftest import MakeApp
from turnstile.cli import serve
from turnstile.settings import SettingsError, load_settings

# Generous on a loaded 2-core machine.
TIMEOUT_S = 10.0


class EchoApp:
    """A small ASGI app: `/echo` answers the body it read (Content-Length), `/chunks`
    answers in three parts without a length, `/fail` raises before answering."""

    def __init__(self) -> None:
        self.lifespan: list[str] = []
        self.reads: list[int] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.lifespan.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if path == "/fail":
            raise RuntimeError("the app failed")
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            self.reads.append(len(message.get("body", b"")))
            if not message.get("more_body"):
                break
        if path == "/chunks":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for part in (b"one,", b"two,", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        answer = b"%s %s %s" % (scope["method"].encode(), scope["raw_path"], body)
        headers = [
            (b"content-length", str(len(answer)).encode()),
            (b"x-query", scope["query_string"]),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await asyncio.sleep(0.01 if path == "/slow" else 0)
        await send({"type": "http.response.body", "body": answer})


def _raw(app: Any) -> LiveServer:
    return LiveServer(app, server="raw")


def _read_responses(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """`count` Content-Length-framed responses: (head, body) each."""
    data = b""
    out: list[tuple[bytes, bytes]] = []
    while len(out) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(out)} responses: {data!r}"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(data) < length:
            data += sock.recv(65536)
        out.append((head, data[:length]))
        data = data[length:]
    return out


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    app = EchoApp()
    with _raw(app) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendall(b"POST /slow?a=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        # the second and third arrive in one write while the first is still being answered
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nde"
            b"GET /echo?b=2 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answers = _read_responses(sock, 3)
    assert [body for _, body in answers] == [b"POST /slow abc", b"POST /echo de", b"GET /echo "]
    assert b"x-query: a=1" in answers[0][0] and b"x-query: b=2" in answers[2][0]
    assert all(head.startswith(b"HTTP/1.1 200 OK") for head, _ in answers)
    assert all(b"\r\ndate: " in head for head, _ in answers)
    assert app.lifespan == ["lifespan.startup", "lifespan.shutdown"]


def test_a_body_without_length_is_chunked_and_head_has_none() -> None:
    with _raw(EchoApp()) as server:
        resp = httpx.get(server.url + "/chunks", timeout=TIMEOUT_S)
        assert resp.headers["transfer-encoding"] == "chunked"
        assert resp.content == b"one,two,three"
        head = httpx.head(server.url + "/echo", timeout=TIMEOUT_S)
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(b"HEAD /echo "))


def test_a_chunked_request_body_reaches_the_app_as_it_arrives() -> None:
    app = EchoApp()
    with _raw(app) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall(b"3\r\nabc\r\n")
        sock.sendall(b"2\r\nde\r\n0\r\n\r\n")
        ((_, body),) = _read_responses(sock, 1)
    assert body == b"POST /echo abcde"
    assert sum(app.reads) == 5


def test_expect_100_continue_is_answered_when_the_app_reads() -> None:
    with _raw(EchoApp()) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"ok")
        ((_, body),) = _read_responses(sock, 1)
    assert body == b"POST /echo ok"


def test_an_app_that_fails_answers_500_and_closes() -> None:
    with _raw(EchoApp()) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendall(b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 500 ") and data.endswith(b"Internal Server Error")
    assert b"connection: close" in data


def test_a_request_that_is_not_http_gets_400_and_is_closed() -> None:
    with _raw(EchoApp()) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 400 ") and b'"error"' in data


def test_turnstile_answers_a_completion_under_raw(make_app: MakeApp) -> None:
    harness = make_app()
    with LiveServer(harness.app, server="raw") as server:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
        stream = httpx.post(
            server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT_S
        )
        assert stream.headers["transfer-encoding"] == "chunked"
        assert stream.text.rstrip().endswith("data: [DONE]")


def test_the_server_setting_and_flag() -> None:
    assert load_settings(None, {}, environ={}).server == "uvicorn"
    assert load_settings(None, {"server": "raw"}, environ={}).server == "raw"
    assert load_settings(None, {}, environ={"TURNSTILE_SERVER": "raw"}).server == "raw"
    with pytest.raises(SettingsError, match="server"):  # measured by the bench only
        load_settings(None, {"server": "granian"}, environ={})
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve._overrides(parser.parse_args(["--server", "raw"]))["server"] == "raw"
    assert serve._overrides(parser.parse_args([]))["server"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--server", "granian"])
