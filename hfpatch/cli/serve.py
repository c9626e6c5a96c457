"""``hfpatch serve``: a pipeline loaded once on every launched rank, behind an HTTP API on rank 0.

.. code-block:: bash

    torchrun --nproc-per-node 8 -m hfpatch serve Wan-AI/Wan2.1-T2V-1.3B-Diffusers --port 8000
    curl -s localhost:8000/v1/videos/generations -H 'Content-Type: application/json' \\
        -d '{"prompt": "a cat surfing", "size": "832x480", "frames": 33, "seed": 0}'

Every rank loads and patches the pipeline as ``hfpatch generate`` does (the same options fix it: ``--parallel``
and the degrees, ``--shard-weights``, ``--cache``, ``--compile``, ``--dtype``, ``--lora``, ``--quantize``; the
call's options become the defaults of every request). Rank 0 then runs a FastAPI app under uvicorn (the
``[serve]`` extra) in a thread; its main thread takes the requests from a bounded queue, one at a time, posts
each to the other ranks through the launcher's store (they wait on it between requests, polling, so an idle
server holds no collective open and no timeout runs out), and every rank runs the same pipeline call in step;
rank 0 answers. A request is checked on rank 0 before it is queued (unknown fields, types, a size the VAE and
the patches cannot tile, too many images): a 4xx that never reaches the other ranks. A call that fails on the
ranks (a lost rank: ``hfpatch.CollectiveError`` within ``HFPATCH_TIMEOUT_S``) is answered 503 and the server
stops: every later request gets 503, ``/health`` turns 503, and the process exits. ``SIGTERM`` or ``SIGINT``
stop taking requests (503), finish the queued ones and stop every rank.

Endpoints: ``POST /v1/images/generations`` and ``POST /v1/videos/generations`` (OpenAI-style bodies: ``prompt``,
``n``, ``size`` ``"WIDTHxHEIGHT"``, ``seed``, ``steps``, ``guidance_scale``, ``negative_prompt``, ``frames`` and
``fps`` for videos; ``response_format`` ``"b64_json"`` (PNG, or MP4 with the ``[video]`` extra) or ``"pt"``, the
raw output tensor saved with ``torch.save``, base64: exactly what ``hfpatch generate --out x.pt`` writes),
``GET /health`` and ``GET /metrics`` (Prometheus text).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .generate import (
    ModelInfo,
    UsageError,
    _call_arguments,
    _launched_world_size,
    check_arguments,
    check_model,
    inspect_model,
    load_and_patch,
    rank_device,
)

__all__ = [
    "PAGE",
    "REQUEST_FIELDS",
    "RequestError",
    "add_serve_arguments",
    "decode_tensor",
    "encode",
    "main",
    "post",
    "request_call",
    "size_multiple",
]

#: Fields a request body may hold, per endpoint kind; anything else is a 400 naming it.
_IMAGE_FIELDS = {
    "prompt",
    "negative_prompt",
    "n",
    "size",
    "seed",
    "steps",
    "guidance_scale",
    "response_format",
    "model",
}
REQUEST_FIELDS = {"image": _IMAGE_FIELDS, "video": _IMAGE_FIELDS | {"frames", "fps"}}
MAX_SIDE = 4096  #: pixels: a larger size is refused before it reaches the ranks
MAX_N = 8  #: images or videos per request
_JOB = "hfpatch/serve/{session}/job/"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hfpatch serve``: ``hfpatch generate``'s without the prompt and outputs, and the server's."""
    from .arguments import add_arguments

    add_arguments(parser, serve=True)
    server = parser.add_argument_group("the server (rank 0)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    server.add_argument(
        "--max-queue",
        type=int,
        default=16,
        metavar="N",
        help="requests waiting at most; more are answered 429 (default: %(default)s)",
    )
    server.add_argument(
        "--ui",
        action="store_true",
        help="serve a web page at / to type a prompt and see the image or video (default: off)",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a request not answered by then gets 504 (dropped if it has not started) (default: %(default)s)",
    )


def post(url: str, body: Any = None, timeout: float = 600.0, raw: bytes | None = None) -> tuple[int, Any]:
    """A minimal client (the standard library's): POST ``body`` as JSON (GET without a body) to ``url``; returns
    ``(status, the JSON answer, or its text)``, 4xx and 5xx included. For scripts and tests; any HTTP client works.

    >>> post("http://127.0.0.1:9/health", timeout=0.5)   # nothing listens there
    Traceback (most recent call last):
    ...
    urllib.error.URLError: <urlopen error [Errno 111] Connection refused>
    """
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload, status = response.read(), response.status
    except urllib.error.HTTPError as exc:
        payload, status = exc.read(), exc.code
    text = payload.decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def decode_tensor(answer: dict[str, Any]) -> Any:
    """The raw output tensor of a ``response_format: "pt"`` answer."""
    import torch

    return torch.load(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))


class RequestError(ValueError):
    """A request that cannot run as given: answered with ``status`` and the message, on rank 0 only."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def size_multiple(pipe: Any) -> int:
    """Pixels the height and width must be a multiple of: the VAE's spatial factor times the 2x2 patches."""
    factor = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8
    return int(factor) * 2


def request_call(
    body: Any, kind: str, info: ModelInfo, defaults: dict[str, Any], multiple: int
) -> tuple[dict[str, Any], int, str, int]:
    """A request body -> ``(pipeline call arguments, seed, response format, fps)``; checks every field.

    Raises:
        RequestError: An unknown field, a wrong type, a size out of range or not a multiple of ``multiple``,
            a video field on an image pipeline, a response format this server does not give.

    >>> from hfpatch.cli.generate import ModelInfo
    >>> info = ModelInfo("FluxPipeline", {}, "image", frozenset({"prompt", "num_images_per_prompt"}))
    >>> request_call({"prompt": "a fox", "size": "64x32", "seed": 3}, "image", info, {}, 16)[:2]
    ({'prompt': 'a fox', 'width': 64, 'height': 32}, 3)
    >>> request_call({"prompt": "a fox", "size": "60x32"}, "image", info, {}, 16)
    Traceback (most recent call last):
    ...
    hfpatch.cli.serve.RequestError: size 60x32: width and height must be multiples of 16 (the VAE's factor x the 2x2 patches), at most 4096
    """
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - REQUEST_FIELDS[kind])
    if unknown:
        raise RequestError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; known: "
            f"{', '.join(sorted(REQUEST_FIELDS[kind]))}"
        )
    if kind == "video" and info.kind != "video":
        raise RequestError(f"{info.pipeline} makes images: use /v1/images/generations")
    if kind == "image" and info.kind == "video":
        raise RequestError(f"{info.pipeline} makes videos: use /v1/videos/generations")

    def typed(name: str, types: tuple[type, ...], what: str) -> Any:
        value = body.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise RequestError(f"{name} must be {what}, got {json.dumps(value)}")
        return value

    prompt = typed("prompt", (str,), "a string")
    if not prompt:
        raise RequestError("prompt is required (a non-empty string)")
    call = {**defaults, "prompt": prompt}
    negative = typed("negative_prompt", (str,), "a string")
    if negative is not None:
        call["negative_prompt"] = negative
    steps = typed("steps", (int,), "a positive integer")
    if steps is not None:
        if not 1 <= steps <= 1000:
            raise RequestError(f"steps must be 1 to 1000, got {steps}")
        call["num_inference_steps"] = steps
    guidance = typed("guidance_scale", (int, float), "a number")
    if guidance is not None:
        call["guidance_scale"] = float(guidance)
    n = typed("n", (int,), "a positive integer")
    if n is not None and n != 1:
        if not 1 <= n <= MAX_N:
            raise RequestError(f"n must be 1 to {MAX_N}, got {n}")
        if "num_images_per_prompt" in info.parameters:
            call["num_images_per_prompt"] = n
        elif "num_videos_per_prompt" in info.parameters:
            call["num_videos_per_prompt"] = n
        else:
            raise RequestError(f"n={n}: {info.pipeline} makes one output per prompt")
    size = typed("size", (str,), 'a string "WIDTHxHEIGHT"')
    if size is not None:
        try:
            width, height = (int(v) for v in size.lower().split("x"))
        except ValueError:
            raise RequestError(f'size must be "WIDTHxHEIGHT", got {json.dumps(size)}') from None
        if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE) or width % multiple or height % multiple:
            raise RequestError(
                f"size {size}: width and height must be multiples of {multiple} (the VAE's factor x the 2x2 "
                f"patches), at most {MAX_SIDE}"
            )
        call["width"], call["height"] = width, height
    frames = typed("frames", (int,), "a positive integer")
    if frames is not None:
        if not 1 <= frames <= 1025:
            raise RequestError(f"frames must be 1 to 1025, got {frames}")
        call[info.frame_argument] = frames
    fps = typed("fps", (int,), "a positive integer") or 16
    seed = typed("seed", (int,), "an integer")
    fmt = typed("response_format", (str,), "a string") or "b64_json"
    if fmt == "url":
        raise RequestError('response_format "url": this server keeps no files; use "b64_json" or "pt"')
    if fmt not in ("b64_json", "pt"):
        raise RequestError(f'response_format must be "b64_json" or "pt", got {json.dumps(fmt)}')
    return call, 0 if seed is None else seed, fmt, fps


@dataclass
class _Job:
    call: dict[str, Any]
    seed: int
    fmt: str
    fps: int
    kind: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _State:
    """What rank 0's request handlers and its main loop share."""

    jobs: queue.Queue
    healthy: bool = True
    stopping: bool = False
    why: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    seconds_per_step: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    store: Any = None
    prefix: str = ""
    world: int = 1

    def peaks(self) -> dict[int, int]:
        """Each rank's peak memory after its last request (what it posted to the store), by rank."""
        if self.store is None:
            return {}
        keys = {r: f"{self.prefix}peak/{r}" for r in range(self.world)}
        return {r: int(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}

    def waiting(self) -> int:
        """Requests in the queue that still want an answer (not dropped by their client or their timeout)."""
        with self.jobs.mutex:
            return sum(1 for job in self.jobs.queue if not job.future.cancelled())

    def count(self, status: int) -> None:
        with self.lock:
            self.counts[str(status)] = self.counts.get(str(status), 0) + 1


def encode(tensor: Any, kind: str, fmt: str, fps: int) -> list[dict[str, str]]:
    """One ``{"b64_json": ...}`` per output: the raw tensor (``fmt="pt"``, all outputs in one), PNGs or MP4s."""
    import torch

    if fmt == "pt":
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return [{"b64_json": base64.b64encode(buffer.getvalue()).decode()}]
    import tempfile

    from .outputs import write_outputs

    suffix = ".mp4" if kind == "video" else ".png"
    with tempfile.TemporaryDirectory() as folder:
        written = write_outputs(tensor, kind, [os.path.join(folder, f"out{suffix}")], fps=fps)
        return [{"b64_json": base64.b64encode(open(path, "rb").read()).decode()} for path in written]


def main(args: argparse.Namespace) -> int:
    """Run ``hfpatch serve`` on this rank; returns the exit status (2: usage error, 1: stopped by a failure)."""
    world_size = _launched_world_size()
    args.out, args.report, args.prompt = [], None, None  # generate's options that serve has not: none given
    try:
        if int(os.environ.get("RANK", "0")) == 0:
            import fastapi  # noqa: F401  (rank 0 serves: a missing extra is a usage error, before loading)
            import uvicorn  # noqa: F401
        check_arguments(args, world_size)
        info = inspect_model(args.model)
        check_model(info, args, world_size)
    except ImportError as exc:
        print(
            f"hfpatch serve: error: {exc.name} is not installed: pip install 'hfpatch[serve]'",
            file=sys.stderr,
        )
        return 2
    except UsageError as exc:
        print(f"hfpatch serve: error: {exc}", file=sys.stderr)
        return 2
    return _serve(args, info, world_size)


def _serve(args: argparse.Namespace, info: ModelInfo, world_size: int) -> int:
    import torch

    from ..distributed import runtime
    from .outputs import output_tensor, peak_memory, quiet_unless_rank0

    rank = int(os.environ.get("RANK", "0")) if world_size > 1 else 0
    device, dtype = rank_device(args)
    restore_voices = quiet_unless_rank0(rank)
    try:
        pipe, patch, _ = load_and_patch(args, info, world_size, device, dtype, {})
        pipe.set_progress_bar_config(disable=True)
        store = runtime.default_store() if world_size > 1 else None
        defaults = _call_arguments(args, info)  # the requests' defaults (no prompt: each request brings one)

        def run(job: dict[str, Any]) -> Any:
            try:
                output = pipe(
                    **job["call"], output_type="pt", generator=torch.Generator().manual_seed(job["seed"])
                )
            finally:  # this rank's peak memory so far, for rank 0's /metrics
                if store is not None:
                    store.set(f"{prefix}peak/{rank}", str(peak_memory(device)[0]))
            return output_tensor(output)

        # Each server of this launch (a script may run several in turn) posts under keys of its own: the ranks
        # count their servers alike (each its own counter in the store).
        prefix = (
            _JOB.format(session=store.add(f"hfpatch/serve/sessions/{rank}", 1)) if store is not None else ""
        )
        if rank != 0:
            print(
                f"hfpatch serve: rank {rank} (pid {os.getpid()}) runs rank 0's requests",
                file=sys.stderr,
                flush=True,
            )
            return _follow(store, prefix, run)
        return _lead(args, info, pipe, patch, store, prefix, run, defaults)
    finally:
        restore_voices()


def _follow(store: Any, prefix: str, run: Any) -> int:
    """Ranks other than 0: run each posted job in step with rank 0 until a stop."""
    from datetime import timedelta

    number = 0
    while True:
        key = f"{prefix}{number}"
        while True:
            try:
                store.wait([key], timedelta(seconds=5))
                break
            except Exception as exc:  # a timeout of the poll: rank 0 is idle
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
        job = json.loads(store.get(key))
        if job.get("stop"):
            return 0 if job.get("healthy", True) else 1
        number += 1
        try:
            run(job)
        except ValueError:  # the pipeline's own input checks: rank 0 raised the same and answers 400
            continue
        except Exception as exc:  # rank 0 fails in the same call: it answers 503 and stops
            print(
                f"hfpatch serve: rank failed in request {number - 1}: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            return 1


def _lead(
    args: argparse.Namespace,
    info: ModelInfo,
    pipe: Any,
    patch: Any,
    store: Any,
    prefix: str,
    run: Any,
    defaults: dict[str, Any],
) -> int:
    """Rank 0: the HTTP server in a thread, the jobs in this thread."""
    import torch.distributed as dist
    import uvicorn

    world = dist.get_world_size() if dist.is_initialized() else 1
    state = _State(jobs=queue.Queue(maxsize=args.max_queue), store=store, prefix=prefix, world=world)
    app = _app(args, info, state, size_multiple(pipe), defaults, str(patch.plan))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
    )

    def stop(signum: int, frame: Any) -> None:
        state.stopping = True

    # Before the server answers /health: a SIGTERM from then on drains the queue.
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=server.run, name="hfpatch-serve-http", daemon=True)
    thread.start()
    print(
        f"hfpatch serve: {info.pipeline} from {args.model}, plan {patch.plan}, on http://{args.host}:{args.port}"
        f" (rank 0: pid {os.getpid()})",
        flush=True,
    )
    number = 0
    try:
        while True:
            try:
                job = state.jobs.get(timeout=0.2)
            except queue.Empty:
                if state.stopping or not state.healthy:
                    break
                continue
            # A job whose client left, or whose time ran out, before it started: dropped.
            if not job.future.set_running_or_notify_cancel():
                continue
            if store is not None:
                payload = {"call": job.call, "seed": job.seed}
                store.set(f"{prefix}{number}", json.dumps(payload))
            number += 1
            started = time.perf_counter()
            try:
                tensor = run({"call": job.call, "seed": job.seed})
            except ValueError as exc:
                # The pipeline's own input checks: every rank raised it, before any collective; all go on.
                job.future.set_exception(RequestError(f"{type(exc).__name__}: {exc}"))
                continue
            except Exception as exc:  # a lost rank, an error on some rank: nothing more can run in step
                state.healthy, state.why = False, f"{type(exc).__name__}: {exc}"
                print(f"hfpatch serve: stopping: {state.why}", file=sys.stderr, flush=True)
                job.future.set_exception(RequestError(f"the ranks failed: {state.why}", 503))
                break
            steps = job.call.get("num_inference_steps") or 1
            state.seconds_per_step = (time.perf_counter() - started) / steps
            job.future.set_result(encode(tensor, job.kind, job.fmt, job.fps))
    finally:
        state.stopping = True
        while True:  # what is left in the queue: answered, never left waiting
            try:
                left = state.jobs.get_nowait()
            except queue.Empty:
                break
            if left.future.set_running_or_notify_cancel():
                left.future.set_exception(RequestError("the server is stopping", 503))
        if store is not None:
            try:
                store.set(f"{prefix}{number}", json.dumps({"stop": True, "healthy": state.healthy}))
            except Exception as exc:  # the launcher's store is gone (a lost node): the other ranks are too
                print(f"hfpatch serve: could not tell the other ranks to stop: {exc}", file=sys.stderr)
        server.should_exit = True
        thread.join(timeout=10)
        if thread.is_alive():  # a connection that would not close: stop without waiting for it
            server.force_exit = True
            thread.join(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if state.healthy else 1


#: The ``--ui`` page: a prompt, size, seed and steps, posted to the pipeline's endpoint; the answer shown in place.
PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>hfpatch serve: {pipeline}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; }}
textarea {{ width: 100%; }} label {{ margin-right: 1rem; }} #error {{ color: #b00020; white-space: pre-wrap; }}
#result img, #result video {{ max-width: 100%; margin-top: 1rem; image-rendering: pixelated; min-width: 256px; }}
</style>
</head>
<body>
<h1>{pipeline}</h1>
<p>{model}, plan <code>{plan}</code></p>
<form id="form">
<p><textarea id="prompt" rows="3" placeholder="a prompt" required></textarea></p>
<p><label>size <input id="size" placeholder="WIDTHxHEIGHT" size="10"></label>
<label>seed <input id="seed" type="number" value="0" size="6"></label>
<label>steps <input id="steps" type="number" min="1" size="4"></label>{frames}
<button id="generate" type="submit">Generate</button></p>
</form>
<p id="status"></p><p id="error"></p><div id="result"></div>
<script>
const kind = "{kind}";
document.getElementById("form").addEventListener("submit", async (event) => {{
  event.preventDefault();
  const body = {{prompt: document.getElementById("prompt").value, seed: Number(document.getElementById("seed").value)}};
  for (const name of ["size", "steps", "frames"]) {{
    const input = document.getElementById(name);
    if (input && input.value) body[name] = name === "size" ? input.value : Number(input.value);
  }}
  const status = document.getElementById("status"), error = document.getElementById("error");
  const result = document.getElementById("result");
  status.textContent = "generating..."; error.textContent = ""; result.innerHTML = "";
  const started = performance.now();
  const response = await fetch(`/v1/${{kind}}s/generations`,
                               {{method: "POST", headers: {{"Content-Type": "application/json"}}, body: JSON.stringify(body)}});
  const answer = await response.json();
  status.textContent = "";
  if (!response.ok) {{ error.textContent = `${{response.status}}: ${{answer.error.message}}`; return; }}
  for (const item of answer.data) {{
    const media = document.createElement(kind === "video" ? "video" : "img");
    media.src = `data:${{kind === "video" ? "video/mp4" : "image/png"}};base64,${{item.b64_json}}`;
    if (kind === "video") {{ media.controls = true; media.loop = true; media.autoplay = true; media.muted = true; }}
    result.appendChild(media);
  }}
  status.textContent = `done in ${{((performance.now() - started) / 1000).toFixed(2)}} s`;
}});
</script>
</body>
</html>
"""


def _app(
    args: argparse.Namespace,
    info: ModelInfo,
    state: _State,
    multiple: int,
    defaults: dict[str, Any],
    plan: str,
) -> Any:
    """The FastAPI app of rank 0."""
    import asyncio

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    app = FastAPI(title="hfpatch serve", docs_url=None, redoc_url=None)

    def error(status: int, message: str) -> JSONResponse:
        state.count(status)
        return JSONResponse(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error" if status < 500 else "server_error",
                }
            },
            status_code=status,
        )

    async def generate(request: Request, kind: str) -> JSONResponse:
        if state.stopping or not state.healthy:
            return error(503, state.why or "the server is stopping")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the body is not JSON")
        try:
            call, seed, fmt, fps = request_call(body, kind, info, defaults, multiple)
        except RequestError as exc:
            return error(exc.status, str(exc))
        job = _Job(call, seed, fmt, fps, kind)
        try:
            state.jobs.put_nowait(job)
        except queue.Full:
            return error(429, f"{args.max_queue} requests are waiting; retry later")
        answer = asyncio.wrap_future(job.future)
        deadline = time.monotonic() + args.request_timeout
        while not answer.done():  # polled: a client that went away drops its job if it has not started
            await asyncio.wait({answer}, timeout=0.25)
            if answer.done():
                break
            if await request.is_disconnected():
                if job.future.cancel():
                    state.count(499)  # nginx's "client closed request": no answer is sent
                return JSONResponse({}, status_code=499)
            if time.monotonic() > deadline:
                job.future.cancel()
                return error(504, f"not answered within {args.request_timeout:g} s")
        try:
            data = answer.result()
        except concurrent.futures.CancelledError:
            return error(504, f"not answered within {args.request_timeout:g} s")
        except RequestError as exc:
            return error(exc.status, str(exc))
        state.count(200)
        return JSONResponse({"created": int(time.time()), "data": data})

    # Starlette routes (each endpoint gets the Request): no FastAPI parameter parsing, the body is checked here.
    async def images(request: Request) -> JSONResponse:
        return await generate(request, "image")

    async def videos(request: Request) -> JSONResponse:
        return await generate(request, "video")

    async def health(request: Request) -> JSONResponse:
        if state.healthy and not state.stopping:
            return JSONResponse({"status": "ready", "pipeline": info.pipeline})
        return JSONResponse({"status": "unhealthy", "why": state.why or "stopping"}, status_code=503)

    async def metrics(request: Request) -> PlainTextResponse:
        with state.lock:
            counts = dict(state.counts)
        lines = ["# TYPE hfpatch_requests_total counter"]
        lines += [f'hfpatch_requests_total{{status="{s}"}} {n}' for s, n in sorted(counts.items())]
        lines += [
            "# TYPE hfpatch_queue_length gauge",
            f"hfpatch_queue_length {state.waiting()}",
            "# TYPE hfpatch_seconds_per_step gauge",
            f"hfpatch_seconds_per_step {state.seconds_per_step:.6f}",
            "# TYPE hfpatch_healthy gauge",
            f"hfpatch_healthy {int(state.healthy and not state.stopping)}",
        ]
        peaks = await asyncio.to_thread(state.peaks)
        if peaks:
            lines.append("# TYPE hfpatch_peak_memory_bytes gauge")
            lines += [f'hfpatch_peak_memory_bytes{{rank="{r}"}} {b}' for r, b in sorted(peaks.items())]
        return PlainTextResponse("\n".join(lines) + "\n")

    app.add_route("/v1/images/generations", images, methods=["POST"])
    app.add_route("/v1/videos/generations", videos, methods=["POST"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    if args.ui:
        import html

        from fastapi.responses import HTMLResponse

        kind = "video" if info.kind == "video" else "image"
        frames = (
            '\n<label>frames <input id="frames" type="number" min="1" size="4"></label>'
            if kind == "video"
            else ""
        )
        text = PAGE.format(
            pipeline=html.escape(info.pipeline), model=html.escape(args.model), plan=html.escape(plan),
            kind=kind, frames=frames,
        )  # fmt: skip

        async def page(request: Request) -> HTMLResponse:
            return HTMLResponse(text)

        app.add_route("/", page, methods=["GET"])
    return app
