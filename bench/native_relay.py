"""A native relay in front of the fleet's engines: nginx, where it is installed.

The fleet bench reads each router's CPU per streamed request. The bare Python relay
(`bench/minimal_passthrough.py`) is the floor for any router written in Python; nginx, relaying
the same streams without buffering them, is the floor for one that is not: what a request and its
events cost a compiled event loop on this machine (a wake-up, a read and a write per event), with
no choice of replica beyond taking the engines in turn and nothing read from the answer. Between
the two floors, what compiling a bare relay saves; the bench's `--answer-tokens 1` splits each
figure into a part per request and a part per event, to say which part a router's own code costs.

One worker process (the gateway serves from one event loop too), access log off, request bodies
kept in memory, answers relayed as they arrive (`proxy_buffering off`), kept-alive connections
to the engines as every other router in the bench keeps them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from bench.harness import GATEWAY_CORE, _taskset, free_port, serving

NGINX = "nginx"
BODY_BUFFER = "16m"  # the fleet's longest prompts stay in memory, never in a temp file


def nginx_path() -> str | None:
    """The nginx binary, or None where it is not installed (Debian: `apt-get install
    nginx-light`)."""
    return shutil.which(NGINX) or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def nginx_config(engines: list[str], port: int, workdir: str) -> str:
    """nginx.conf relaying 127.0.0.1:`port` to `engines` ("http://host:port" each) in turn,
    with every file it writes under `workdir`."""
    servers = "\n".join(f"    server {e.removeprefix('http://')};" for e in engines)
    temp = "\n".join(
        f"  {kind}_temp_path {workdir}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process on;
worker_processes 1;
user root;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log error;
events {{ worker_connections 4096; }}
http {{
  access_log off;
{temp}
  upstream engines {{
{servers}
    keepalive 256;
  }}
  server {{
    listen 127.0.0.1:{port};
    client_max_body_size 64m;
    client_body_buffer_size {BODY_BUFFER};
    keepalive_requests 100000;
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 120s;
    }}
  }}
}}
"""


def start_nginx(engines: list[str], workdir: str) -> tuple[subprocess.Popen, str]:
    """nginx on the gateway's core in front of `engines`, writing its files in `workdir` (the
    caller's to remove): the process (its worker is its child, so the tree's CPU is nginx's)
    and the chat URL."""
    binary = nginx_path()
    if binary is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light)")
    port = free_port()
    conf = os.path.join(workdir, "nginx.conf")
    with open(conf, "w") as fh:
        fh.write(nginx_config(engines, port, workdir))
    argv = [*_taskset(GATEWAY_CORE), binary, "-p", workdir, "-c", conf]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    serving(proc, f"http://127.0.0.1:{port}/v1/models")
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"
