"""``turnstream.services.gateway.http.listening_socket``: the gateway's port, bound before anything
starts, and one clear line when it cannot be (a port in use, a port below 1024, a host not of this
machine)."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys

import pytest

from schemas.errors import TurnstreamError
from turnstream.services.gateway.http import http_url, listening_socket, reuse_port_listener


def test_a_free_port_is_bound_inheritable_and_reusable() -> None:
    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0
        assert sock.get_inheritable()  # --workers: the worker processes inherit it
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)


def test_reuse_port_workers_each_listen_on_the_held_port_and_a_plain_bind_is_refused() -> None:
    """``--worker-routing any``: the supervisor's socket holds the port without listening;
    each worker's own socket there takes connections; a process binding it without
    SO_REUSEPORT (another gateway started on the same port) is still told it is in use."""
    with listening_socket("127.0.0.1", 0, reuse_port=True) as held:
        port = held.getsockname()[1]
        workers = [reuse_port_listener(held, 16) for _ in range(2)]
        try:
            for worker in workers:
                assert worker.getsockname() == held.getsockname()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                ready, _, _ = select.select(workers, [], [], 10)
                assert len(ready) == 1  # the kernel queued it at one of them
                ready[0].accept()[0].close()
            with pytest.raises(TurnstreamError, match="in use"):
                listening_socket("127.0.0.1", port)
        finally:
            for worker in workers:
                worker.close()


def test_an_ipv6_host_is_bound_and_its_url_bracketed() -> None:
    with listening_socket("::1", 0) as sock:
        assert sock.family == socket.AF_INET6
        assert http_url("::1", sock.getsockname()[1]).startswith("http://[::1]:")


def test_a_port_in_use_names_the_address_and_what_to_pass() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(TurnstreamError) as refused:
            listening_socket("127.0.0.1", port)
    assert str(refused.value) == (
        f"cannot listen on 127.0.0.1:{port}: Address already in use; pass another --port "
        "(0: a free one), or stop what listens there"
    )


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])
def test_a_host_not_of_this_machine_names_it(host: str) -> None:
    with pytest.raises(TurnstreamError, match=f"cannot listen on {host}:0: .*pass --host"):
        listening_socket(host, 0)


def test_a_privileged_port_says_so() -> None:
    code = (
        "from turnstream.services.gateway.http import listening_socket\n"
        "try:\n    listening_socket('127.0.0.1', 80)\n"
        "except Exception as exc:\n    print(exc)\n"
    )
    # The tests run as root here and in CI, where any port binds: the child runs without the
    # capability to bind ports below 1024 (util-linux's setpriv), as an unprivileged user would.
    drop = ["setpriv", "--bounding-set", "-net_bind_service"] if os.geteuid() == 0 else []
    result = subprocess.run(
        [*drop, sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert "cannot listen on 127.0.0.1:80: Permission denied; ports below 1024 need root" in (
        result.stdout
    ), result.stdout + result.stderr
