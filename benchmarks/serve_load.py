"""``hfpatch serve`` under load: 40 requests from 4 concurrent clients against a tiny Flux on 2 CPU ranks.

The server (``torchrun --nproc-per-node 2 -m hfpatch serve FOLDER --parallel 2 --max-queue 2``, the tiny random
Flux of ``hfpatch.testing`` saved as a diffusers folder, 16x16 images, 4 steps) first answers each of the 10 seeds
once, alone (the references); then 4 client threads start together and post 10 requests each (the 10 seeds, each
client its own order), retrying after a 429. Reports, as JSON and a plot:

- every answer against its seed's reference (bit for bit: none lost, none mixed up) and the 429s the queue bound gave;
- latency per request (post to answer, retries included: p50, p95, max) and throughput (answers per second), alone
  and under load, on this machine's 2 CPU cores (the ranks compute; the clients and the server thread share the
  cores with them).

Writes ``benchmarks/results/serve_load.json`` and ``.png``; about a minute.

    python benchmarks/serve_load.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hfpatch.cli.serve import decode_tensor, post

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CLIENTS, SEEDS = 4, list(range(10))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(latencies: list[float], seconds: float) -> dict[str, float]:
    return {
        "requests": len(latencies),
        "p50_s": statistics.median(latencies),
        "p95_s": _percentile(latencies, 0.95),
        "max_s": max(latencies),
        "throughput_per_s": len(latencies) / seconds,
    }


def main() -> dict[str, Any]:
    from hfpatch.testing import tiny_flux_pipe_with_text_encoders

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "flux"
        tiny_flux_pipe_with_text_encoders().save_pretrained(folder)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        options = ["--steps", "4", "--pipeline-kwargs", '{"max_sequence_length": 8}', "--parallel", "2"]
        log = open(Path(tmp) / "serve.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hfpatch", "serve",
             str(folder), *options, "--port", str(port), "--max-queue", "2"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/v1/images/generations"
        try:
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((Path(tmp) / "serve.log").read_text()[-4000:])
                try:
                    if post(f"http://127.0.0.1:{port}/health", timeout=5)[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.3)

            def ask(seed: int) -> tuple[torch.Tensor, float, int]:
                started, refused = time.perf_counter(), 0
                while True:
                    body = {"prompt": "a fox", "size": "16x16", "seed": seed, "response_format": "pt"}
                    status, answer = post(url, body)
                    if status != 429:
                        break
                    refused += 1
                    time.sleep(0.02)
                if status != 200:
                    raise RuntimeError(f"seed {seed}: {status} {answer}")
                return decode_tensor(answer), time.perf_counter() - started, refused

            started = time.perf_counter()
            alone = [ask(seed) for seed in SEEDS]
            alone_s = time.perf_counter() - started
            reference = {seed: found[0] for seed, found in zip(SEEDS, alone)}

            answers: list[tuple[int, torch.Tensor, float, int]] = []
            lock, start = threading.Lock(), threading.Barrier(CLIENTS)

            def client(index: int) -> None:
                start.wait()
                for seed in SEEDS[index:] + SEEDS[:index]:
                    tensor, latency, refused = ask(seed)
                    with lock:
                        answers.append((seed, tensor, latency, refused))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            load_s = time.perf_counter() - started
            metrics = post(f"http://127.0.0.1:{port}/metrics")[1]
        finally:
            if server.poll() is None:
                found = re.search(r"\(rank 0: pid (\d+)\)", (Path(tmp) / "serve.log").read_text())
                if found:  # SIGTERM to rank 0 stops every rank
                    os.kill(int(found.group(1)), signal.SIGTERM)
                    server.wait(timeout=60)
                else:
                    server.kill()
            log.close()

    results: dict[str, Any] = {
        "server": "tiny FluxPipeline, 16x16, 4 steps, torchrun 2 CPU ranks (Ulysses 2), --max-queue 2",
        "clients": CLIENTS,
        "requests": len(answers),
        "all_answered": len(answers) == CLIENTS * len(SEEDS),
        "each_its_own_seed": all(torch.equal(t, reference[s]) for s, t, _, _ in answers),
        "seeds_differ": len({reference[s].sum().item() for s in SEEDS}) == len(SEEDS),
        "refused_429": sum(r for _, _, _, r in answers),
        "alone": _summary([latency for _, latency, _ in alone], alone_s),
        "under_load": _summary([latency for _, _, latency, _ in answers], load_s),
        "metrics": metrics,
        "latencies_under_load_s": [latency for _, _, latency, _ in answers],
    }
    print(
        f"{results['requests']} requests from {CLIENTS} clients: all answered {results['all_answered']}, each its own "
        f"seed's image {results['each_its_own_seed']}, 429s {results['refused_429']}; alone p50 "
        f"{results['alone']['p50_s'] * 1e3:.0f} ms, under load p50 {results['under_load']['p50_s'] * 1e3:.0f} ms, "
        f"p95 {results['under_load']['p95_s'] * 1e3:.0f} ms, {results['under_load']['throughput_per_s']:.2f} "
        f"answers/s (alone {results['alone']['throughput_per_s']:.2f})"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_load.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "serve_load.png")
    return results


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))

    latencies = sorted(1e3 * v for v in results["latencies_under_load_s"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))], "o-", markersize=3)
    for key, style in (("p50_s", "--"), ("p95_s", ":")):
        ax.axvline(
            1e3 * results["under_load"][key], linestyle=style, color="gray", label=key.removesuffix("_s")
        )
    ax.axvline(1e3 * results["alone"]["p50_s"], color="green", label="p50 alone")
    ax.set(
        xlabel="latency per request (ms, 429 retries included)", ylabel="fraction of requests", ylim=(0, 1.02)
    )
    ax.set_title(
        f"hfpatch serve: {results['requests']} requests from {results['clients']} clients (2 CPU ranks)"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
