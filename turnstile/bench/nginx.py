"""nginx as the bench's reference reverse proxy: render a config, start it, stop it.

The config is what a careful operator would run in front of a streaming LLM server:
one worker process, an upstream pool with `keepalive 256` over HTTP/1.1, response
buffering off (SSE events pass through as they come), no access log, listening on
127.0.0.1 only. Everything nginx writes (pid file, error log, temp paths) goes into a
directory of the caller's, so it needs no system paths and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from turnstile.bench import child_pids, healthy, stop_group, wait_until

NGINX_CANDIDATES: Final[tuple[str, ...]] = ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
# Idle upstream connections nginx keeps per worker: as many as the bench's top concurrency.
UPSTREAM_KEEPALIVE: Final[int] = 256
# Well above 256 clients plus 256 upstream connections.
WORKER_CONNECTIONS: Final[int] = 4096
# nginx closes a keep-alive connection after 1,000 requests by default (client side
# and upstream); the bench would then measure reconnects, so the limit is lifted.
KEEPALIVE_REQUESTS: Final[int] = 10_000_000
# A paced stream lasts seconds; nginx must not time it out between events.
PROXY_READ_TIMEOUT_S: Final[int] = 300
# nginx starts in milliseconds; this much is allowed for a slow or loaded machine.
START_TIMEOUT_S: Final[float] = 15.0
# `nginx -t` reads and checks the config only.
CONFIG_TEST_TIMEOUT_S: Final[float] = 15.0
# `-e` (error log path at start-up, before the config is read) exists from nginx 1.19.5.
ERROR_LOG_FLAG_SINCE: Final[tuple[int, int, int]] = (1, 19, 5)


def find_nginx() -> str | None:
    """The nginx binary, or None when it is not installed."""
    for path in NGINX_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("nginx")


def nginx_version(binary: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run(
            [binary, "-v"], capture_output=True, timeout=CONFIG_TEST_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(rb"nginx/(\d+)\.(\d+)\.(\d+)", out.stderr + out.stdout)
    if found is None:
        return None
    major, minor, patch = (int(x) for x in found.groups())
    return major, minor, patch


def render_config(
    workdir: Path, listen_port: int, upstream_port: int, *, master_process: bool = True
) -> str:
    """The nginx.conf text for proxying 127.0.0.1:`listen_port` to :`upstream_port`."""
    d = workdir.resolve()
    # As root the master hands the worker to `nobody`; as anyone else there is no switch.
    user = "user nobody nogroup;\n" if os.geteuid() == 0 else ""
    return f"""# turnstile bench: nginx in front of the fake backend
{user}daemon off;
master_process {"on" if master_process else "off"};
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;

events {{
    worker_connections {WORKER_CONNECTIONS};
}}

http {{
    access_log off;
    client_body_temp_path {d}/client_body_temp;
    proxy_temp_path {d}/proxy_temp;
    fastcgi_temp_path {d}/fastcgi_temp;
    uwsgi_temp_path {d}/uwsgi_temp;
    scgi_temp_path {d}/scgi_temp;
    keepalive_requests {KEEPALIVE_REQUESTS};

    upstream bench_backend {{
        server 127.0.0.1:{upstream_port};
        keepalive {UPSTREAM_KEEPALIVE};
        keepalive_requests {KEEPALIVE_REQUESTS};
    }}

    server {{
        listen 127.0.0.1:{listen_port};
        location / {{
            proxy_pass http://bench_backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout {PROXY_READ_TIMEOUT_S}s;
        }}
    }}
}}
"""


def _command(binary: str, conf: Path, workdir: Path) -> list[str]:
    cmd = [binary, "-c", str(conf), "-p", f"{workdir.resolve()}/"]
    version = nginx_version(binary)
    if version is not None and version >= ERROR_LOG_FLAG_SINCE:
        cmd += ["-e", str(workdir.resolve() / "error.log")]
    return cmd


def write_config(workdir: Path, listen_port: int, upstream_port: int) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        # the worker runs as nobody and must reach its temp paths in here
        workdir.chmod(0o755)
    conf = workdir / "nginx.conf"
    conf.write_text(render_config(workdir, listen_port, upstream_port))
    return conf


def check_config(binary: str, conf: Path, workdir: Path) -> tuple[bool, str]:
    """Run `nginx -t` on `conf`: (passed, nginx's output)."""
    try:
        out = subprocess.run(
            [*_command(binary, conf, workdir), "-t"],
            capture_output=True,
            timeout=CONFIG_TEST_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, "nginx -t timed out"
    text = (out.stdout + out.stderr).decode(errors="replace")
    return out.returncode == 0, text


class NginxError(RuntimeError):
    """nginx would not start or serve."""


@dataclass
class Nginx:
    """A running nginx; `pids` are the master's and its worker's."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    port: int
    pids: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def error_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "error.log").read_text(errors="replace")
        return ""

    def stop(self) -> None:
        """Graceful shutdown (SIGQUIT), then SIGKILL to the group if it lingers."""
        stop_group(self.proc, signal.SIGQUIT)


def start_nginx(binary: str, workdir: Path, listen_port: int, upstream_port: int) -> Nginx:
    """Start nginx in its own process group; returns once it proxies GET /health."""
    conf = write_config(workdir, listen_port, upstream_port)
    ok, text = check_config(binary, conf, workdir)
    if not ok:
        raise NginxError(f"nginx rejected its config:\n{text}")
    proc = subprocess.Popen(
        _command(binary, conf, workdir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = Nginx(proc, workdir, listen_port)
    try:
        ready = wait_until(
            lambda: (
                proc.poll() is not None or (bool(child_pids(proc.pid)) and healthy(listen_port))
            ),
            START_TIMEOUT_S,
        )
        if proc.poll() is not None:
            raise NginxError(f"nginx exited with {proc.returncode}:\n{server.error_log()}")
        if not ready:
            raise NginxError(f"nginx did not come up in {START_TIMEOUT_S} s:\n{server.error_log()}")
        server.pids = [proc.pid, *child_pids(proc.pid)]
    except BaseException:
        server.stop()
        raise
    return server
