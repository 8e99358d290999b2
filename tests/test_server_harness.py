"""The test/benchmark server launcher refuses a port another process already listens on: its /health answer would
be taken for the new server's (a stray server on port 30000 once failed six CI tests that way, with a message about
the worker's mode instead of the port)."""

import socket
import sys

import pytest

from sglang_dflash.testing import Server


def test_start_refuses_a_port_in_use(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        srv = Server([sys.executable, "-c", "pass"], tmp_path / "log", port)
        with pytest.raises(RuntimeError, match=f"port {port} .* already in use"):
            srv.start()
        assert srv.proc is None  # nothing was launched


def test_start_on_a_free_port_launches(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = Server([sys.executable, "-c", "print('ran')"], tmp_path / "log", port)
    srv.start()
    srv.proc.wait(timeout=30)
    assert "ran" in (tmp_path / "log").read_text()
