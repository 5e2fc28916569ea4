"""``python -m simulation.gpusim``: a config's simulated fleet in one process, ready line, clean stop on
SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from inferlb.config.schema import parse_config
from inferlb.request import headers
from simulation.gpusim.__main__ import select_endpoints


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp_path: Path, ports: list[int]) -> Path:
    doc = {
        "simulation": {"prefill_tokens_per_s": 1_000_000, "decode_tokens_per_s": 5_000},
        "models": [{"name": "m", "default_max_tokens": 4}],
        "endpoints": [
            {
                "name": "gpu-a",
                "address": f"127.0.0.1:{ports[0]}",
                "model": "m",
                "gpu": "A100",
                "simulated": True,
            },
            {
                "name": "gpu-b",
                "address": f"127.0.0.1:{ports[1]}",
                "model": "m",
                "gpu": "V100",
                "simulated": True,
            },
            {"name": "real", "address": f"127.0.0.1:{ports[2]}", "model": "m", "gpu": "H100"},
        ],
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def read_until(stream: asyncio.StreamReader, marker: str, timeout_s: float = 30.0) -> str:
    seen = ""
    async with asyncio.timeout(timeout_s):
        while marker not in seen:
            line = await stream.readline()
            if not line:
                raise AssertionError(f"process ended before {marker!r}; output:\n{seen}")
            seen += line.decode()
    return seen


async def test_runs_the_simulated_endpoints_and_stops_on_sigterm(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    config = write_config(tmp_path, ports)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulation.gpusim", "--config", str(config), "--log-level", "info",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        log = await read_until(proc.stderr, "gpusim ready: 2 endpoints")
        assert "gpu-a" in log
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for port, name in ((ports[0], "gpu-a"), (ports[1], "gpu-b")):
                async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                    assert resp.status == 200
                    assert resp.headers[headers.ENDPOINT] == name
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions", json=body) as resp:
                assert (await resp.json())["usage"]["completion_tokens"] == 4
            with pytest.raises(aiohttp.ClientConnectionError):
                # not simulated: nothing listens there
                await http.get(f"http://127.0.0.1:{ports[2]}/health")
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_unknown_only_name_exits_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, [free_port() for _ in range(3)])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulation.gpusim", "--config", str(config), "--only", "nope",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"nope" in err
    assert b"gpu-a" in err  # the known names are listed


def test_only_selects_named_endpoints_even_when_not_simulated(tmp_path: Path) -> None:
    config = parse_config(yaml.safe_load(write_config(tmp_path, [8101, 8102, 8103]).read_text()))
    assert [e.display_name for e in select_endpoints(config, None)] == ["gpu-a", "gpu-b"]
    assert [e.display_name for e in select_endpoints(config, ["real", "gpu-a", "real"])] == ["real", "gpu-a"]
