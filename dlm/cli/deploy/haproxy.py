"""An HAProxy configuration in front of `dlm serve` replicas (docs/deploy.md, "Behind a proxy").

HAProxy rather than nginx because open-source nginx has no active health checks: HAProxy
polls each replica's `/ready`, so a replica that is loading, draining (SIGTERM) or restarting
leaves the rotation by itself, as a Kubernetes readiness probe would take it out of a Service.

- **Least outstanding requests:** `balance leastconn` counts the requests a server is
  serving now (not idle pooled connections).
- **Retries only for requests that never started:** `retry-on conn-failure 503`. A refused or
  failed connection never reached the server; dlm answers 503 only before a request starts
  (`not_ready`, `draining`, `engine_failed`) or for a non-streamed one cut at the end of the
  shutdown grace (`shutdown`), which sent nothing to the client. Nothing else is replayed: no
  retry on timeouts, on a connection closed mid-request, or once the answer has begun.
  `option http-buffer-request` holds each request whole, so a retry can resend it.
- **SSE without buffering:** HAProxy forwards response data as it arrives (no compression,
  no response buffering), and `option http-no-delay` sends each event at once instead of
  waiting to fill a packet, which otherwise held the first chunk back by ~150 ms here.
- **One server connection per request** (`option http-server-close`; clients keep theirs):
  a replica that stops closes its idle connections, and a request sent on one as it closes
  would be lost mid-way, which no safe retry covers. A fresh connection on a local network
  costs well under a millisecond against requests that take hundreds.
- **Weighted split between groups** (A/B: dLLM vs AR, version A vs B): the front end sends
  each request to a split backend that round-robins by weight over one internal front end
  per group, so the shares are exact over each cycle of `sum(weights)` requests (no random
  draw); each group then balances its own replicas by least outstanding requests. A group
  with no ready replica answers 503 for its share rather than moving it to the other group:
  an A/B comparison must not silently become A/A.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from dlm.engine.errors import UsageError

# ASCII only (re.ASCII: `\d` and `\w` are otherwise any script's digits and letters, which
# int() reads but HAProxy refuses in a name, a host or a port), anchored at the very end.
GROUP = re.compile(r"^(?P<name>[A-Za-z][\w-]*)(?::(?P<weight>\d+))?=(?P<servers>.+)\Z", re.ASCII)
ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[\w.-]+):(?P<port>\d{1,5})\Z", re.ASCII)
MAX_WEIGHT = 256  # HAProxy's server weight range is 0..256
# which group and replica answered (set where the group's backend is known)
SERVED_BY = "    http-response set-header X-Dlm-Served-By %[be_name]/%[srv_name]"


@dataclass(frozen=True)
class Group:
    """One deployment: its replicas and its share of the traffic."""

    name: str
    weight: int
    servers: tuple[str, ...]


def parse_group(spec: str) -> Group:
    """`NAME[:WEIGHT]=HOST:PORT[,HOST:PORT...]`, e.g. `llada:80=10.0.0.1:8000,10.0.0.2:8000`."""
    match = GROUP.match(spec)
    if match is None:
        raise UsageError(f"--group {spec!r}: expected NAME[:WEIGHT]=HOST:PORT[,HOST:PORT...]")
    servers = tuple(s.strip() for s in match["servers"].split(",") if s.strip())
    for server in servers:
        address = ADDRESS.match(server)
        if address is None or not 0 < int(address["port"]) < 65536:
            raise UsageError(f"--group {match['name']}: {server!r} is not HOST:PORT")
    weight = int(match["weight"]) if match["weight"] is not None else 1
    if not 0 < weight <= MAX_WEIGHT:
        raise UsageError(f"--group {match['name']}: weight must be 1..{MAX_WEIGHT}, got {weight}")
    if not servers:
        raise UsageError(f"--group {match['name']}: no servers")
    return Group(match["name"], weight, servers)


@dataclass(frozen=True)
class ProxySettings:
    groups: tuple[Group, ...]
    bind: str = "0.0.0.0:8080"
    check_interval_ms: int = 1000  # how often each replica's /ready is polled
    request_timeout: float = 300.0  # dlm serve's request_timeout: the longest answer (a stream) may take
    connect_timeout_ms: int = 2000
    retries: int = 3

    def validate(self) -> ProxySettings:
        if not self.groups:
            raise UsageError("give at least one --group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise UsageError(f"group names repeat: {', '.join(names)}")
        if ADDRESS.match(self.bind) is None:
            raise UsageError(f"--bind {self.bind!r} is not HOST:PORT")
        if self.check_interval_ms < 100:
            raise UsageError(f"--check-interval-ms must be at least 100, got {self.check_interval_ms}")
        if self.request_timeout <= 0:
            raise UsageError(f"--request-timeout must be positive, got {self.request_timeout}")
        return self


def _group_backend(group: Group, settings: ProxySettings) -> list[str]:
    lines = [
        f"backend group_{group.name}",
        "    balance leastconn",
        "    option httpchk GET /ready",
        "    http-check expect status 200",
        "    option http-buffer-request",  # a retry resends the request: hold all of it first
        "    retry-on conn-failure 503",
        f"    retries {settings.retries}",
        "    option redispatch 1",
        f"    default-server check inter {settings.check_interval_ms} fall 1 rise 1",
    ]
    lines += [f"    server {group.name}{i} {address}" for i, address in enumerate(group.servers)]
    return lines


def render(settings: ProxySettings) -> str:
    """The whole haproxy.cfg: `haproxy -f FILE` runs it as is."""
    settings.validate()
    timeout_s = math.ceil(settings.request_timeout) + 30  # the server ends a request first
    # internal sockets are named per configuration, so two proxies on one host never collide
    tag = hashlib.sha256(repr(settings).encode()).hexdigest()[:10]
    lines = [
        "# Rendered by `dlm deploy haproxy`; see docs/deploy.md.",
        "global",
        "    log stderr format short local0 warning",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option http-no-delay",
        "    option http-server-close",
        f"    timeout connect {settings.connect_timeout_ms}ms",
        f"    timeout client {timeout_s}s",
        f"    timeout server {timeout_s}s",
        "    timeout http-request 30s",
        "    timeout check 2s",
        "",
        "frontend dlm",
        f"    bind {settings.bind}",
    ]
    if len(settings.groups) == 1:
        lines += [SERVED_BY, f"    default_backend group_{settings.groups[0].name}", ""]
        lines += _group_backend(settings.groups[0], settings)
        return "\n".join(lines) + "\n"
    lines += ["    default_backend split", "", "backend split", "    balance roundrobin"]
    lines += [f"    server {g.name} abns@dlm-{tag}-{g.name} weight {g.weight} send-proxy-v2" for g in settings.groups]
    for group in settings.groups:
        lines += [
            "",
            f"frontend group_{group.name}",
            f"    bind abns@dlm-{tag}-{group.name} accept-proxy",
            SERVED_BY,
            f"    default_backend group_{group.name}",
            "",
            *_group_backend(group, settings),
        ]
    return "\n".join(lines) + "\n"
