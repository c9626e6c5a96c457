"""``hfpatch serve`` under torchrun at 2 CPU ranks: a real HTTP client against the tiny saved Flux and Wan pipelines.

One launch runs, in the same two processes (a launch costs ~7 s of CPU per process), ``hfpatch generate`` on the
tiny Flux (the reference: ``--out ref.pt`` and ``ref.png``), ``hfpatch serve`` with the same options until
``SIGTERM``, then the same for the tiny Wan (a video). The client checks:

* the served image equals ``hfpatch generate``'s: the raw tensor (``response_format: "pt"``) bit for bit, and the
  PNG (``b64_json``) byte for byte; the served video's tensor bit for bit and its MP4 byte for byte;
* bad requests get a 400 that says what to change and never reach the ranks: the next request still runs, and
  another seed gives another image;
* 4 clients at once with a queue of 2: the requests over the bound get 429, retried; every answer is its own
  seed's image (none lost or mixed up);
* a request not answered within ``--request-timeout``: 504; a client that goes away while its request waits in
  the queue: the request is dropped, never run;
* ``/health`` is 200 once every rank has loaded, ``/metrics`` counts the answers and shows each rank's peak memory;
* ``SIGTERM`` to rank 0 stops every rank cleanly (exit status 0 after both servers).

A second launch kills rank 1 during a long request: that request is answered 503 within ``HFPATCH_TIMEOUT_S`` + 5 s
and the server stops (503, then nothing listens), the launch exits with a failure.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from cli_commands import ROOT, checkout_env, launch  # noqa: E402

from hfpatch.cli.serve import decode_tensor, post  # noqa: E402

TEXT = ["--pipeline-kwargs", '{"max_sequence_length": 8}']
FLUX = ["--steps", "2", *TEXT, "--parallel", "2"]
WAN = ["--steps", "2", "--negative-prompt", "blurry", *TEXT, "--parallel", "2"]
TIMEOUT_S = 10  # HFPATCH_TIMEOUT_S of the launches


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Launch:
    """``hfpatch`` commands run one after the other in one torchrun launch of 2 processes, output in a file."""

    def __init__(self, folder: Path, commands: list[list[str]]) -> None:
        self.log_path = folder / "launch.log"
        env = {**checkout_env(), "OMP_NUM_THREADS": "1", "HFPATCH_TIMEOUT_S": str(TIMEOUT_S)}
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(  # tests/cli_commands.py runs the commands one after the other
            launch(commands, folder), stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )

    def output(self) -> str:
        return self.log_path.read_text()[-6000:]

    def wait_ready(self, base: str, pipeline: str) -> None:
        deadline = time.monotonic() + 300
        while True:
            assert self.process.poll() is None, self.output()
            try:
                status, health = post(f"{base}/health", timeout=5)
                if status == 200:
                    assert health == {"status": "ready", "pipeline": pipeline}, health
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.3)

    def pid(self, rank: int) -> int:
        pattern = r"\(rank 0: pid (\d+)\)" if rank == 0 else rf"rank {rank} \(pid (\d+)\)"
        return int(re.findall(pattern, self.log_path.read_text())[-1])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _concurrent(url: str, seeds: list[int], clients: int) -> tuple[dict[int, list[torch.Tensor]], int]:
    """``clients`` threads posting their share of ``seeds`` at once (a 429 is retried); their images by seed and
    the number of 429s."""
    found: dict[int, list[torch.Tensor]] = {}
    refused = [0]
    lock, start = threading.Lock(), threading.Barrier(clients)

    def client(mine: list[int]) -> None:
        start.wait()
        for seed in mine:
            while True:
                status, answer = post(
                    url, {"prompt": "a fox", "size": "16x16", "seed": seed, "response_format": "pt"}
                )
                if status != 429:
                    break
                with lock:
                    refused[0] += 1
                time.sleep(0.05)
            assert status == 200, answer
            with lock:
                found.setdefault(seed, []).append(decode_tensor(answer))

    threads = [threading.Thread(target=client, args=(seeds[i::clients],)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return found, refused[0]


def test_serve_images_and_videos_equal_generate_refuse_bad_requests_queue_and_stop(tmp_path):
    from hfpatch.testing import tiny_flux_pipe_with_text_encoders, tiny_wan_pipe

    flux, wan = tmp_path / "flux", tmp_path / "wan"
    tiny_flux_pipe_with_text_encoders().save_pretrained(flux)
    tiny_wan_pipe(text_encoder=True).save_pretrained(wan)
    ports = _port(), _port()
    commands = [
        ["generate", str(flux), "--prompt", "a fox", "--height", "16", "--width", "16", "--seed", "3", *FLUX,
         "--out", str(tmp_path / "ref.pt"), "--out", str(tmp_path / "ref.png")],
        ["serve", str(flux), *FLUX, "--port", str(ports[0]), "--max-queue", "2", "--request-timeout", "3"],
        ["generate", str(wan), "--prompt", "a cat", "--height", "32", "--width", "32", "--frames", "5", "--seed",
         "5", *WAN, "--out", str(tmp_path / "video.pt"), "--out", str(tmp_path / "video.mp4")],
        ["serve", str(wan), *WAN, "--port", str(ports[1])],
    ]  # fmt: skip
    launch = _Launch(tmp_path, commands)
    try:
        base = f"http://127.0.0.1:{ports[0]}"
        images = f"{base}/v1/images/generations"
        launch.wait_ready(base, "FluxPipeline")
        body = {"prompt": "a fox", "size": "16x16", "seed": 3}
        status, answer = post(images, {**body, "response_format": "pt"})
        assert status == 200, answer
        reference = torch.load(tmp_path / "ref.pt")
        assert torch.equal(decode_tensor(answer), reference)
        status, answer = post(images, body)
        assert status == 200, answer
        assert base64.b64decode(answer["data"][0]["b64_json"]) == (tmp_path / "ref.png").read_bytes()

        bad = {
            "size 17x16": ({**body, "size": "17x16"}, "must be multiples of"),
            "an unknown field": ({**body, "quality": "hd"}, "unknown field quality"),
            "a wrong type": ({**body, "seed": "3"}, "seed must be an integer"),
            "no prompt": ({"size": "16x16"}, "prompt is required"),
            "a url": ({**body, "response_format": "url"}, 'use "b64_json" or "pt"'),
            "a video field": ({**body, "frames": 5}, "unknown field frames"),
            "a huge size": ({**body, "size": "65536x16"}, "at most 4096"),
        }
        for what, (request, said) in bad.items():
            status, answer = post(images, request)
            assert status == 400 and said in answer["error"]["message"], (what, status, answer)
        status, answer = post(images, raw=b"{not json")
        assert status == 400 and "not JSON" in answer["error"]["message"], answer
        status, answer = post(f"{base}/v1/videos/generations", body)
        assert status == 400 and "/v1/images/generations" in answer["error"]["message"], answer

        # The ranks were not touched: the next request runs; another seed gives another image.
        seeds = [10, 11, 12, 13]
        alone = {}
        for seed in seeds:
            status, answer = post(images, {**body, "seed": seed, "response_format": "pt"})
            assert status == 200, answer
            alone[seed] = decode_tensor(answer)
        assert alone[10].shape == reference.shape and not torch.equal(alone[10], reference)

        # 4 clients at once, 3 requests each, a queue of 2: none lost or mixed up, the bound answered 429.
        found, refused = _concurrent(images, seeds * 3, clients=4)
        assert sorted(found) == seeds and all(len(found[s]) == 3 for s in seeds), {
            s: len(v) for s, v in found.items()
        }
        assert all(torch.equal(t, alone[s]) for s, got in found.items() for t in got)
        assert refused >= 1, "4 clients at once never filled a queue of 2"

        # A request not answered within --request-timeout (3 s; 1000 steps take 10 s or more): 504 (it had started:
        # it runs to its end). A client that goes away while its request waits behind it: the request is dropped,
        # never run (counted 499).
        running: list[tuple[int, Any]] = []
        slow = threading.Thread(
            target=lambda: running.append(post(images, {**body, "seed": 20, "steps": 1000}))
        )
        slow.start()
        time.sleep(1.0)  # the slow request runs; the next one waits in the queue
        payload = json.dumps({**body, "seed": 21}).encode()
        with socket.create_connection(("127.0.0.1", ports[0])) as gone:
            gone.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            time.sleep(0.5)
        slow.join(timeout=120)
        assert running[0][0] == 504 and "not answered within 3 s" in running[0][1]["error"]["message"], (
            running
        )

        status, metrics = post(f"{base}/metrics")
        assert status == 200
        answered = 2 + len(seeds) + 12
        assert f'hfpatch_requests_total{{status="200"}} {answered}' in metrics, metrics
        assert 'hfpatch_requests_total{status="400"} 9' in metrics, metrics
        assert f'hfpatch_requests_total{{status="429"}} {refused}' in metrics, metrics
        assert 'hfpatch_requests_total{status="499"} 1' in metrics, metrics  # the client that went away
        assert 'hfpatch_requests_total{status="504"} 1' in metrics, metrics
        assert "hfpatch_queue_length 0" in metrics and "hfpatch_healthy 1" in metrics, metrics
        peaks = re.findall(r'hfpatch_peak_memory_bytes\{rank="(\d)"\} (\d+)', metrics)
        assert [r for r, _ in peaks] == ["0", "1"] and all(int(b) > 0 for _, b in peaks), metrics
        os.kill(
            launch.pid(0), signal.SIGTERM
        )  # the flux server stops; the launch goes on with the Wan commands

        base = f"http://127.0.0.1:{ports[1]}"
        launch.wait_ready(base, "WanPipeline")
        video = {"prompt": "a cat", "size": "32x32", "frames": 5, "seed": 5}
        status, answer = post(f"{base}/v1/videos/generations", {**video, "response_format": "pt"})
        assert status == 200, answer
        assert torch.equal(decode_tensor(answer), torch.load(tmp_path / "video.pt"))
        status, answer = post(f"{base}/v1/videos/generations", video)
        assert status == 200, answer
        assert base64.b64decode(answer["data"][0]["b64_json"]) == (tmp_path / "video.mp4").read_bytes()
        status, answer = post(f"{base}/v1/images/generations", {"prompt": "a cat"})
        assert status == 400 and "/v1/videos/generations" in answer["error"]["message"], answer
        os.kill(launch.pid(0), signal.SIGTERM)
        status = launch.process.wait(timeout=60)
        assert status == 0, (status, launch.output())
    finally:
        launch.close()


def test_serve_a_rank_killed_mid_request_turns_into_503_and_stops(tmp_path):
    from hfpatch.testing import tiny_wan_pipe

    wan = tmp_path / "wan"
    tiny_wan_pipe(text_encoder=True).save_pretrained(wan)
    port = _port()
    launch = _Launch(tmp_path, [["serve", str(wan), *WAN, "--port", str(port)]])
    try:
        base = f"http://127.0.0.1:{port}"
        launch.wait_ready(base, "WanPipeline")
        answers: list[tuple[int, float, Any]] = []

        def long_request() -> None:  # hundreds of steps: still running when rank 1 dies
            body = {"prompt": "a cat", "size": "32x32", "frames": 5, "steps": 1000, "response_format": "pt"}
            status, answer = post(f"{base}/v1/videos/generations", body)
            answers.append((status, time.monotonic(), answer))

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(2.0)
        assert thread.is_alive(), answers
        killed = time.monotonic()
        os.kill(launch.pid(1), signal.SIGKILL)
        thread.join(timeout=TIMEOUT_S + 30)
        status, when, answer = answers[0]
        assert status == 503 and "the ranks failed" in answer["error"]["message"], answer
        assert when - killed <= TIMEOUT_S + 5, when - killed
        try:  # the next request: 503 while the server stops, or nothing listens any more
            status, _ = post(f"{base}/v1/videos/generations", {"prompt": "a cat"}, timeout=10)
            assert status == 503
        except OSError:
            pass
        assert launch.process.wait(timeout=60) != 0, launch.output()
    finally:
        launch.close()


def _browser() -> str | None:
    """A Chromium for Playwright to drive: Playwright's own, or the system's (Debian's ``chromium``)."""
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_serve_ui_in_a_real_browser_shows_the_served_image(tmp_path):
    """``--ui``: a headless Chromium (driven by Playwright) opens the page, types a prompt, size and seed, clicks
    Generate, and the image on the page is the PNG the API answers for the same request, byte for byte; a bad
    size shows the server's 400 message on the page."""
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = _browser()
    if executable is None:
        pytest.skip("no Chromium: apt-get install chromium (Debian), or `playwright install chromium`")
    from hfpatch.testing import tiny_flux_pipe_with_text_encoders

    flux = tmp_path / "flux"
    tiny_flux_pipe_with_text_encoders().save_pretrained(flux)
    port = _port()
    launch = _Launch(tmp_path, [["serve", str(flux), *FLUX, "--port", str(port), "--ui"]])
    try:
        base = f"http://127.0.0.1:{port}"
        launch.wait_ready(base, "FluxPipeline")
        status, answer = post(
            f"{base}/v1/images/generations", {"prompt": "a red fox", "size": "16x16", "seed": 7}
        )
        assert status == 200, answer
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=executable, headless=True, args=["--no-sandbox"]
            )
            page = browser.new_page()
            page.goto(base + "/")
            assert "FluxPipeline" in page.title()
            page.fill("#prompt", "a red fox")
            page.fill("#size", "16x16")
            page.fill("#seed", "7")
            page.click("#generate")
            image = page.wait_for_selector("#result img", timeout=60_000)
            shown = image.get_attribute("src")
            assert shown == "data:image/png;base64," + answer["data"][0]["b64_json"]
            assert page.evaluate("document.querySelector('#result img').naturalWidth") == 16
            page.fill("#size", "17x16")
            page.click("#generate")
            page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=60_000)
            assert page.text_content("#error").startswith("400: size 17x16")
            browser.close()
        os.kill(launch.pid(0), signal.SIGTERM)
        status = launch.process.wait(timeout=60)
        assert status == 0, (status, launch.output())
    finally:
        launch.close()
