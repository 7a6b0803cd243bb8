"""This host's own addresses, and the two rules that follow from them.

* No proxy for local traffic. A proxy named in the environment (``http_proxy``, ``https_proxy``,
  ``grpc_proxy``) is for traffic that leaves the host, but gRPC sends a channel to a loopback
  address through it too: the engine's decisions would fail, or travel through a stranger's
  machine. Channels to a unix socket or a loopback address switch the proxy off
  (``channel_options``); a channel to another host keeps the environment's proxy settings.
* Nothing listens beyond this host by default. The sidecar and the engine's metrics steer or
  describe an engine's memory; an address other than loopback is a choice stated on the command
  line (``check_metrics_addr``; the sidecar's own listener needs TLS, ``sidecar.check_listen``).
"""
from __future__ import annotations

import ipaddress

NO_PROXY = ("grpc.enable_http_proxy", 0)


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP literal (``127.0.0.0/8``, ``::1``; brackets allowed)."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name: it may resolve anywhere


def is_local_target(address: str) -> bool:
    """Whether a gRPC target stays on this host: ``unix:...`` or ``[dns:///]HOST:PORT`` with a loopback HOST."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    if address.startswith("dns:"):
        address = address[len("dns:"):].lstrip("/")
    host, sep, _ = address.rpartition(":")
    return bool(sep) and is_loopback_host(host)


def channel_options(address: str) -> list[tuple[str, int]]:
    """gRPC channel options for ``address``: the proxy switched off where the target is local."""
    return [NO_PROXY] if is_local_target(address) else []


def url_host(host: str) -> str:
    """``host`` as it stands in a URL (an IPv6 literal in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_metrics_addr(addr: str, public: bool, option: str = "--metrics-addr") -> None:
    """Refuse a metrics address that is not loopback unless ``public`` (``--metrics-public``) says so."""
    if not addr or any(c.isspace() for c in addr):
        raise ValueError(f"{option} {addr!r}: expected a host name or IP address, e.g. 127.0.0.1")
    if not public and not is_loopback_host(addr):
        raise ValueError(f"{option} {addr}: not a loopback address; the metrics would be served to the network, "
                         f"unauthenticated: add --metrics-public to mean it")


def check_target(address: str, option: str = "--controller") -> None:
    """Refuse a gRPC target that is neither ``unix:PATH`` nor ``[dns:///]HOST:PORT`` (a port in 1..65535)."""
    for scheme in ("unix:", "unix-abstract:"):
        if address.startswith(scheme):
            if not address[len(scheme):].lstrip("/"):
                raise ValueError(f"{option} {address}: a unix socket needs a path, e.g. unix:///tmp/rlctl.sock")
            return
    rest = address[len("dns:"):].lstrip("/") if address.startswith("dns:") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535 or any(c.isspace() for c in rest):
        raise ValueError(f"{option} {address}: expected unix:///path or HOST:PORT (a port in 1..65535), "
                         "e.g. 127.0.0.1:50051")


def check_pem(path: str | None, option: str) -> None:
    """Refuse a TLS file that is missing or holds no PEM block, naming the option, before anything runs."""
    if path is None:
        return
    from pathlib import Path

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot be read ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{option} {path}: not a PEM file (no -----BEGIN line)")
