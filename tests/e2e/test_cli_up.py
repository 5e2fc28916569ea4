"""`inferlb up` as a user runs it: a child process that prints the gateway and a sample curl, serves a chat
completion from a simulated GPU, and on SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from inferlb.config.schema import load_config
from inferlb.request.headers import ENDPOINT
from tests.conftest import make_config_doc, write_config
from tests.e2e.conftest import REQUEST_PATH_MODES, http_request, in_mode

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("mode", REQUEST_PATH_MODES)
def test_inferlb_up_serves_and_stops_everything_on_sigterm(tmp_path: Path, mode: str) -> None:
    path = write_config(tmp_path / "c.yaml", in_mode(make_config_doc(), mode))
    cfg = load_config(path)
    out_path = tmp_path / "up.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inferlb.ops.cli", "up", str(path), "--workdir", str(tmp_path / "work")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
        )
    try:
        deadline = time.monotonic() + 90
        while b"Ctrl-C stops everything" not in out_path.read_bytes():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)
        text = out_path.read_text()
        assert f"http://{cfg.gateway.listen}" in text and f"http://{cfg.gateway.admin}" in text
        assert "curl -sS" in text
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for piece in ("xds_server", f"-m {mode}", "gpusim", "envoy"):
            assert piece in names
        other = next(m for m in REQUEST_PATH_MODES if m != mode)
        assert f"-m {other} " not in names  # one request-path service, the config's
        r = http_request(
            str(cfg.gateway.listen),
            "POST",
            "/v1/chat/completions",
            {
                "model": cfg.models[0].name,
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 16,
            },
            {"Authorization": "Bearer sk-demo-a"},
        )
        assert r.status == 200, r.body
        assert r.headers[ENDPOINT] in {e.display_name for e in cfg.endpoints}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
