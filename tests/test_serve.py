"""``hfpatch serve`` under torchrun at 2 CPU ranks: a real HTTP client against the tiny saved Flux pipeline.

One launch runs ``hfpatch generate`` (the reference: ``--out ref.pt`` and ``ref.png``) and then ``hfpatch serve``
with the same options in the same two processes (a launch costs ~7 s of CPU per process). The client checks:

* the served image equals ``hfpatch generate``'s: the raw tensor (``response_format: "pt"``) bit for bit, and the
  PNG (``b64_json``) byte for byte;
* bad requests get a 400 that says what to change and never reach the ranks: the next request still runs, and
  another seed gives another image;
* ``/health`` is 200 once every rank has loaded, ``/metrics`` counts the answers;
* ``SIGTERM`` to rank 0 stops every rank cleanly (exit status 0).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ["--steps", "2", "--pipeline-kwargs", '{"max_sequence_length": 8}', "--parallel", "2"]

DRIVER = """\
import json, sys
from hfpatch.cli import main

for argv in json.loads(open(sys.argv[1]).read()):
    status = main(argv)
    if status:
        sys.exit(status)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            payload = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        payload, status = exc.read(), exc.code
    text = payload.decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _decode_tensor(answer: dict[str, Any]) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))


def test_serve_two_ranks_equals_generate_refuses_bad_requests_and_stops_on_sigterm(tmp_path):
    from hfpatch.testing import tiny_flux_pipe_with_text_encoders

    folder = tmp_path / "flux"
    tiny_flux_pipe_with_text_encoders().save_pretrained(folder)
    port = _port()
    commands = [
        ["generate", str(folder), "--prompt", "a fox", "--height", "16", "--width", "16", "--seed", "3", *OPTIONS,
         "--out", str(tmp_path / "ref.pt"), "--out", str(tmp_path / "ref.png")],
        ["serve", str(folder), *OPTIONS, "--port", str(port), "--max-queue", "4"],
    ]  # fmt: skip
    (tmp_path / "commands.json").write_text(json.dumps(commands))
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", HFPATCH_TIMEOUT_S="60")
    log = open(tmp_path / "serve.log", "w")
    launch = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(tmp_path / "driver.py"),
         str(tmp_path / "commands.json")],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert launch.poll() is None, (tmp_path / "serve.log").read_text()[-6000:]
            try:
                status, health = _request(f"{base}/health")
                if status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-6000:]
            time.sleep(0.5)
        assert health == {"status": "ready", "pipeline": "FluxPipeline"}

        body = {"prompt": "a fox", "size": "16x16", "seed": 3}
        status, answer = _request(f"{base}/v1/images/generations", {**body, "response_format": "pt"})
        assert status == 200, answer
        assert torch.equal(_decode_tensor(answer), torch.load(tmp_path / "ref.pt"))
        status, answer = _request(f"{base}/v1/images/generations", body)
        assert status == 200, answer
        assert base64.b64decode(answer["data"][0]["b64_json"]) == (tmp_path / "ref.png").read_bytes()

        bad = {
            "size 17x16": ({**body, "size": "17x16"}, "must be multiples of"),
            "an unknown field": ({**body, "quality": "hd"}, "unknown field quality"),
            "a wrong type": ({**body, "seed": "3"}, "seed must be an integer"),
            "no prompt": ({"size": "16x16"}, "prompt is required"),
            "a url": ({**body, "response_format": "url"}, 'use "b64_json" or "pt"'),
            "a video field": ({**body, "frames": 5}, "unknown field frames"),
        }
        for what, (request, said) in bad.items():
            status, answer = _request(f"{base}/v1/images/generations", request)
            assert status == 400 and said in answer["error"]["message"], (what, status, answer)
        status, answer = _request(f"{base}/v1/images/generations", raw=b"{not json")
        assert status == 400 and "not JSON" in answer["error"]["message"], answer
        status, answer = _request(f"{base}/v1/videos/generations", body)
        assert status == 400 and "/v1/images/generations" in answer["error"]["message"], answer

        # The ranks were not touched: the next request runs, and another seed gives another image.
        status, answer = _request(
            f"{base}/v1/images/generations", {**body, "seed": 4, "response_format": "pt"}
        )
        assert status == 200, answer
        other = _decode_tensor(answer)
        assert other.shape == torch.load(tmp_path / "ref.pt").shape
        assert not torch.equal(other, torch.load(tmp_path / "ref.pt"))

        status, metrics = _request(f"{base}/metrics")
        assert status == 200
        assert 'hfpatch_requests_total{status="200"} 3' in metrics and 'status="400"} 8' in metrics, metrics
        assert "hfpatch_queue_length 0" in metrics and "hfpatch_healthy 1" in metrics, metrics

        rank0 = int(re.search(r"\(rank 0: pid (\d+)\)", (tmp_path / "serve.log").read_text()).group(1))
        os.kill(rank0, signal.SIGTERM)
        assert launch.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()[-6000:]
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        log.close()
