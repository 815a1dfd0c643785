"""Starting servers on free loopback ports: the port `free_port()` returned can be taken by another process
before the server binds it; `start_server` starts it again on a new port."""

from __future__ import annotations

import socket
import sys

import httpx
import pytest

from serving import serve_local


@pytest.mark.server
def test_a_port_taken_between_free_port_and_bind_is_retried(tmp_path, monkeypatch):
    with socket.socket() as taken:  # another process wins the race for the first port handed out
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lost = taken.getsockname()[1]
        handed_out = iter([lost])
        free_port = serve_local.free_port
        monkeypatch.setattr(serve_local, "free_port", lambda: next(handed_out, None) or free_port())
        log = tmp_path / "server.log"
        proc, port = serve_local.start_server(
            lambda p: [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(p)],
            lambda p: f"http://127.0.0.1:{p}/",
            log,
            cwd=tmp_path,
        )
        try:
            assert port != lost
            first = (tmp_path / "server.log.port-taken-1").read_text().lower()
            assert serve_local.ADDRESS_IN_USE in first  # the first start failed on the taken port ...
            assert (
                httpx.get(f"http://127.0.0.1:{port}/", timeout=30).status_code == 200
            )  # ... the retry serves
        finally:
            serve_local.stop(proc)


@pytest.mark.server
def test_a_server_that_fails_for_another_reason_is_not_retried(tmp_path):
    with pytest.raises(RuntimeError, match="No module named nowhere"):
        serve_local.start_server(
            lambda p: [sys.executable, "-m", "nowhere", str(p)],
            lambda p: f"http://127.0.0.1:{p}/",
            tmp_path / "log",
        )
    assert not list(tmp_path.glob("log.port-taken-*"))
