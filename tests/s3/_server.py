"""A loopback S3 endpoint (moto's standalone server) and a fault-injecting HTTP proxy.

The proxy forwards each request to the server unless a rule matches it: a rule answers
with an error status (500, 503 SlowDown) or resets the connection after reading part of
the request body, a given number of times, or first calls a rule's `action` (a test kills a
rank with it when that rank's request arrives). Used by tests and `benchmarks/bench_s3.py`.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, List, Optional, Tuple

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> Tuple[subprocess.Popen, str]:
    """Starts `moto_server` on a free loopback port; returns the process and its endpoint."""
    port = free_port()
    exe = shutil.which("moto_server") or os.path.join(
        os.path.dirname(sys.executable), "moto_server"
    )
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start within 30 s")


def env(endpoint: str) -> Dict[str, str]:
    """The standard AWS environment for `endpoint` (retries quick enough for tests)."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Rule:
    """Faults for requests whose `METHOD path?query` contains `match`."""

    match: str
    status: int = 503  # 0: reset the connection mid-body
    code: str = "SlowDown"
    times: int = 1
    hits: int = 0
    action: Optional[Callable[[], None]] = None


class FaultProxy:
    """A threaded HTTP proxy on a free loopback port in front of `target`."""

    def __init__(self, target: str) -> None:
        self.rules: List[Rule] = []
        self.seen: List[str] = []
        host, port = target.split("//")[1].split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                what = f"{self.command} {self.path} {self.headers.get('Authorization', '')}"
                proxy.seen.append(what)
                n = int(self.headers.get("Content-Length") or 0)
                rule = proxy._take(what)
                if rule is not None and rule.action is not None:
                    rule.action()
                if rule is not None and rule.status == 0:  # read some of the body, then RST
                    self.rfile.read(min(n, 1024))
                    linger = struct.pack("ii", 1, 0)
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                    self.close_connection = True
                    return
                body = self.rfile.read(n) if n else b""
                if rule is not None:
                    err = f"<Error><Code>{rule.code}</Code><Message>injected</Message></Error>"
                    self._reply(rule.status, {"Content-Type": "application/xml"}, err.encode())
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                skip = ("transfer-encoding", "connection", "content-length")
                kept = {k: v for k, v in r.getheaders() if k.lower() not in skip}
                if self.command == "HEAD":  # the object's length, not the (empty) body's
                    kept["Content-Length"] = r.getheader("Content-Length") or "0"
                self._reply(r.status, kept, data)
                conn.close()

            def _reply(self, status: int, headers: Dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _take(self, what: str) -> Optional[Rule]:
        for rule in self.rules:
            if rule.match in what and rule.hits < rule.times:
                rule.hits += 1
                return rule
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
