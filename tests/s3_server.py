"""A real S3 server for tests: moto's standalone server on loopback, and a fault-injecting proxy.

Import the fixtures into a test module::

    from tests.s3_server import fault_proxy, s3_env  # noqa: F401

``s3_env`` starts one moto server per test process (first use), creates a fresh bucket for the
test and points the standard AWS environment variables at it (fake credentials, endpoint,
region). ``fault_proxy`` puts a :class:`FaultProxy` between the client and the server and points
``AWS_ENDPOINT_URL`` at the proxy: it can reset connections, answer 5xx for the next N requests
(or all of them), throttle uploads, and stall chosen requests.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

FAKE_ACCESS_KEY = "AKIAIOSFODNN7EXAMPLE"
FAKE_SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"

_ERROR_CODES = {"500": ("Internal Server Error", "InternalError"), "503": ("Service Unavailable", "ServiceUnavailable")}


class MotoServer:
    """moto's standalone S3 server (``moto.server.ThreadedMotoServer``) on a free loopback port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = find_free_network_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop()


_SERVER: MotoServer | None = None
_SERVER_LOCK = threading.Lock()


def moto_server() -> MotoServer:
    """The process-wide moto server, started on first use and stopped at exit."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = MotoServer()
            atexit.register(_SERVER.stop)
        return _SERVER


# ----------------------------------------------------------------------------- fault proxy


class _Conn:
    """Buffered reads from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def read_until(self, marker: bytes) -> bytes | None:
        while marker not in self.buf:
            if not self._fill():
                return None
        head, self.buf = self.buf.split(marker, 1)
        return head + marker

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                break
        data, self.buf = self.buf[:n], self.buf[n:]
        return data


class FaultProxy:
    """HTTP proxy on loopback in front of an upstream server, injecting faults per request.

    Attributes:
        requests: Requests seen.
        matched: Requests that matched the methods and path given to the last :meth:`fail_next` /
            :meth:`fail_always` since that call, failed or answered.
        faults: Faults injected.
        bytes_up: Request bytes forwarded upstream (uploads).
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self._upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._always: str | None = None
        self._methods: tuple[str, ...] | None = None
        self._path_part: str | None = None
        self.matched = 0
        self._rate: float | None = None
        self._hold: tuple[str, str] | None = None
        self._released = threading.Event()
        self.held: list[str] = []
        self.requests = 0
        self.faults = 0
        self.bytes_up = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    # ------------------------------------------------------------------ control
    def fail_next(self, n: int, kind: str = "503", methods: tuple[str, ...] | None = None,
                  path_part: str | None = None) -> None:
        """Fail the next ``n`` matching requests: ``kind`` is "reset", "500" or "503"; a request matches
        when its method is one of ``methods`` and its path (query included) holds ``path_part``
        (``"list-type=2"``: ListObjectsV2), each when given."""
        with self._lock:
            self._pending = [kind] * n
            self._always = None
            self._methods, self._path_part, self.matched = methods, path_part, 0

    def fail_always(self, kind: str = "500", methods: tuple[str, ...] | None = None,
                    path_part: str | None = None) -> None:
        """Fail every matching request (see :meth:`fail_next`) until :meth:`clear`."""
        with self._lock:
            self._pending = []
            self._always = kind
            self._methods, self._path_part, self.matched = methods, path_part, 0

    def clear(self) -> None:
        with self._lock:
            self._pending, self._always, self._methods, self._path_part = [], None, None, None

    def throttle(self, bytes_per_second: float | None) -> None:
        """Limit upload speed (None: no limit)."""
        self._rate = bytes_per_second

    def hold(self, method: str, path_part: str) -> None:
        """Stall every ``method`` request whose path contains ``path_part`` until :meth:`release`;
        stalled requests are then dropped unanswered. Their paths are appended to ``held``."""
        self._released.clear()
        self._hold = (method, path_part)

    def release(self) -> None:
        self._hold = None
        self._released.set()

    def stop(self) -> None:
        self._closed = True
        self.release()
        self._sock.close()

    # ------------------------------------------------------------------ serving
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests += 1
            if self._methods is not None and method not in self._methods:
                return None
            if self._path_part is not None and self._path_part not in path:
                return None
            self.matched += 1
            kind = self._pending.pop(0) if self._pending else self._always
            if kind is not None:
                self.faults += 1
            return kind

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            conn = _Conn(client)
            head = conn.read_until(b"\r\n\r\n")
            if head is None:
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path = (lines[0].split(" ") + ["", ""])[:2]
            hold = self._hold
            if hold is not None and method == hold[0] and hold[1] in path:
                with self._lock:
                    self.held.append(path)
                self._released.wait()
                return
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    name, value = line.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            expect = headers.get("expect", "").lower() == "100-continue"
            fault = self._take_fault(method, path)
            if fault is not None:
                if not expect:
                    self._drain_body(conn, headers)
                if fault == "reset":
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    self._send_error(client, fault, head_only=method == "HEAD")
                return
            kept = [lines[0]] + [
                line
                for line in lines[1:]
                if line and line.split(":", 1)[0].strip().lower() not in ("connection", "expect")
            ]
            new_head = ("\r\n".join(kept) + "\r\nConnection: close\r\n\r\n").encode("latin-1")
            if expect:
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            upstream = socket.create_connection(self._upstream)
            upstream.sendall(new_head)
            pump = threading.Thread(target=self._pump_up, args=(conn, upstream), daemon=True)
            pump.start()
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        finally:
            for s in (upstream, client):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass

    def _pump_up(self, conn: _Conn, upstream: socket.socket) -> None:
        try:
            data, conn.buf = conn.buf, b""
            while True:
                if data:
                    for i in range(0, len(data), 16384):
                        chunk = data[i : i + 16384]
                        if self._rate:
                            time.sleep(len(chunk) / self._rate)
                        upstream.sendall(chunk)
                        with self._lock:
                            self.bytes_up += len(chunk)
                data = conn.sock.recv(65536)
                if not data:
                    return
        except OSError:
            return

    @staticmethod
    def _drain_body(conn: _Conn, headers: dict[str, str]) -> None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = conn.read_until(b"\r\n")
                if size_line is None:
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while conn.read_until(b"\r\n") not in (None, b"\r\n"):
                        pass
                    return
                conn.read_exact(size + 2)
        else:
            conn.read_exact(int(headers.get("content-length", "0") or 0))

    @staticmethod
    def _send_error(client: socket.socket, status: str, head_only: bool) -> None:
        reason, code = _ERROR_CODES[status]
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by the test proxy</Message><RequestId>{uuid.uuid4().hex}</RequestId></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        client.sendall(head if head_only else head + body)


# ----------------------------------------------------------------------------- fixtures


@dataclass
class S3Env:
    bucket: str
    endpoint: str
    port: int

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}/run"

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=FAKE_ACCESS_KEY,
            aws_secret_access_key=FAKE_SECRET_KEY,
            region_name="us-east-1",
        )

    def objects(self) -> dict[str, bytes]:
        """Every object in the bucket: key -> content."""
        s3 = self.client()
        out = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for item in page.get("Contents", []):
                out[item["Key"]] = s3.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
        return out


UNSET_AWS = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE")
"""Variables that would take precedence over :func:`aws_variables` and are removed."""


def aws_variables(env: S3Env) -> dict[str, str]:
    """The AWS environment pointing at ``env``'s server (with :data:`UNSET_AWS` removed)."""
    return {
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": env.endpoint,
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        # botocore's own per-request retries off: the retries under test are lightning_hpp's
        "AWS_MAX_ATTEMPTS": "1",
    }


@contextlib.contextmanager
def fresh_bucket() -> Iterator[S3Env]:
    """A fresh bucket on the loopback moto server, emptied and deleted at the end."""
    server = moto_server()
    env = S3Env(bucket=f"ckpt-{uuid.uuid4().hex[:10]}", endpoint=server.endpoint, port=server.port)
    env.client().create_bucket(Bucket=env.bucket)
    yield env
    s3 = env.client()
    for key in env.objects():
        s3.delete_object(Bucket=env.bucket, Key=key)
    s3.delete_bucket(Bucket=env.bucket)


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Env]:
    """A fresh bucket on the loopback moto server, and the AWS environment pointing at it."""
    with fresh_bucket() as env:
        for name in UNSET_AWS:
            monkeypatch.delenv(name, raising=False)
        for name, value in aws_variables(env).items():
            monkeypatch.setenv(name, value)
        yield env


@pytest.fixture
def fault_proxy(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the moto server; ``AWS_ENDPOINT_URL`` points at it."""
    proxy = FaultProxy(s3_env.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    yield proxy
    proxy.stop()
