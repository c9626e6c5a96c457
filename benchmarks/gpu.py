"""One GPU: hfpatch's CUDA paths against the stock model, in one command (JSON + plot, about 5 minutes on an H100).

Sections (each timed with CUDA synchronisation, median of repeats after a warm-up; a failing section is
recorded with its error and the others still run; a section that would start past ``--budget-s`` is
skipped and says so):

1. ``attention``: 12 heads x 128, bf16, 4k-64k tokens: stock ``F.scaled_dot_product_attention`` vs every
   hfpatch local kernel that runs here (``local_attention``: forward; ``ring_attention(group=None)``: the
   Ring path's forward + block backward through autograd) and the ring-degree-1 path (``usp_attention``,
   one SDPA call); output error vs stock SDPA. Acceptance: ring degree 1 within 1.05x of stock SDPA, Ring
   blocks within 1.15x of cuDNN (forward + backward).
2. ``wan_forward``: ``WanTransformer3DModel`` at the Wan2.1-T2V-1.3B config (random weights), 21 latent
   frames of 480x832 (32,760 tokens), bf16: stock vs every self-attention through ``usp_attention`` at degree
   1 (the path each rank of a Ulysses split runs) and through the Ring path (lse kernels).
3. ``streaming``: ``StreamingWanPipeline`` (4 steps + context pass per block of 3 latent frames, window 12,
   sink 3) on that transformer with the Wan 2.1 VAE: frames/s of the transformer alone, with the VAE decode
   after it, and with the decode overlapped on a side CUDA stream (end to end), each eager, compiled
   (``StreamingConfig(compile=True)``) and compiled with CUDA graphs (``cuda_graphs=True``). Goal: at least 24
   pixel frames/s end to end at 480x832.
3b. ``streaming_sp``: the same stream split over every GPU of the machine (``parallel=N`` for N = 2, 4, 8 up to
   the GPU count: Ulysses up to the 12 heads, then Ring; the VAE decode split by height): steady block time,
   frames/s of the transformer alone and end to end, cache bytes per rank. Ranks are spawned on NCCL, one per GPU.
   With fewer than two GPUs (and on CPU) it is skipped and says so; ``--sp-ranks N`` runs it on N gloo CPU ranks
   (with ``--device cpu --tiny``: a check that the path works, not a timing).
4. ``pixel_loss``: ``chunked_pixel_loss`` on the FLUX.1 VAE config at 1024x1024: step peak (forward +
   backward) one-shot at batch 1 and 2 vs hfpatch chunk 1 at batch 4.
5. ``gradcache``: BERT-base (random weights), InfoNCE, batch 256 x 128 tokens, bf16 autocast: step time and
   peak of GradCache at chunks 32 and 64 over the plain step, eager and ``GradCache(compile=True)`` (at chunk
   64 also with the loss in row blocks, ``InfoNCELoss``). Goal: at most 1.3x a plain step at chunk 64,
   compiled. Then the loss stage alone at CLIP scale (32,768 pairs x 768, CLIP's loss, forward + backward):
   time and peak of ``CLIPLoss`` in row blocks against the whole matrix.

``--device cpu --tiny`` runs every section on tiny configs in seconds (the test suite does, so the script
cannot rot); CPU peaks are then live tensor bytes (``hfpatch.testing.memory``), CUDA peaks
``torch.cuda.max_memory_allocated``.

Run: ``python benchmarks/gpu.py`` (or ``hfpatch bench gpu``); writes ``benchmarks/results/gpu.json`` and
``.png`` (``--out DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata as metadata
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
GiB = 2**30
WAN_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)  # fmt: skip
WAN_TINY = {**WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
            "out_channels": 4, "text_dim": 32, "ffn_dim": 64, "num_layers": 2}  # fmt: skip
FLUX_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
    latent_channels=16, norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
    use_post_quant_conv=False, mid_block_add_attention=True,
)  # fmt: skip
KL_TINY = {**FLUX_VAE, "block_out_channels": [8, 16], "down_block_types": ["DownEncoderBlock2D"] * 2,
           "up_block_types": ["UpDecoderBlock2D"] * 2, "norm_num_groups": 4, "latent_channels": 4}  # fmt: skip
STEPS = (1000.0, 750.0, 500.0, 250.0)


# ------------------------------------------------------------------------------------------------ measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int = 1, repeats: int = 3) -> float:
    """Median milliseconds of ``fn()`` (synchronised) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated before (CUDA: the allocator's counter;
    CPU: live tensor bytes, deterministic)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from hfpatch.testing.memory import track_memory

    with track_memory() as memory:
        fn()
    return memory.peak_bytes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device)}
    for name in ("diffusers", "transformers", "accelerate", "hfpatch"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_mem_gib=round(props.total_memory / GiB, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())  # fmt: skip
    return env


def _to_dtype(model, dtype):
    """``model.to(dtype)`` keeping ``_keep_in_fp32_modules`` in fp32, as ``from_pretrained(torch_dtype=)``."""
    if dtype == torch.float32:
        return model
    model.to(dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and any(m in name.split(".") for m in keep):
            tensor.data = tensor.data.float()
    return model


# ------------------------------------------------------------------------------------------------ attention
def attention(args, device, dtype, result) -> None:
    from hfpatch.attention.local import available_backends, resolve_backend

    heads, dim = (2, 16) if args.tiny else (12, 128)
    lengths = (64, 256) if args.tiny else (4096, 8192, 16384, 32760, 65536)
    kernels = [k for k in available_backends(device, dtype, dim) if k != "math" or args.tiny]
    result.update(heads=heads, head_dim=dim, dtype=str(dtype), kernels=kernels,
                  auto=resolve_backend("auto", device, dtype, dim).name, rows={})  # fmt: skip
    for seq in lengths:
        result["rows"][seq] = _attention_row(args, device, dtype, seq, heads, dim, kernels)


def _attention_row(args, device, dtype, seq, heads, dim, kernels) -> dict:
    from hfpatch.attention import ring_attention, usp_attention
    from hfpatch.attention.local import local_attention

    gen = torch.Generator().manual_seed(seq)
    q, k, v, dout = (torch.randn(1, seq, heads, dim, generator=gen).to(device, dtype) for _ in range(4))
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]  # what a stock DiT hands SDPA
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(*bhsd).transpose(1, 2)
    row = {}

    def fwd_bwd(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return lambda: fn(*leaves).backward(dout)

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)
        ).transpose(1, 2)

    def usp(a, b, c):
        return usp_attention(a, b, c, ulysses_group=None, ring_group=None)[0]

    cases = {
        "stock sdpa": (lambda: sdpa(q, k, v), fwd_bwd(sdpa)),
        "usp degree 1 (sdpa)": (lambda: usp(q, k, v), fwd_bwd(usp)),
    }
    for name in kernels:
        cases[f"ring path: {name}"] = (
            lambda name=name: local_attention(*bhsd, backend=name)[0].transpose(1, 2),
            fwd_bwd(lambda a, b, c, name=name: ring_attention(a, b, c, group=None, backend=name)[0]),
        )
    for name, (forward, step) in cases.items():
        try:
            with torch.no_grad():
                out = forward()
                entry = {"rel_vs_stock": rel(out, ref), "fwd_ms": timed(forward, device, 1, args.repeats)}
            del out
            entry["fwd_bwd_ms"] = timed(step, device, 1, args.repeats)
            entry["tflops_fwd"] = 4 * seq * seq * heads * dim / entry["fwd_ms"] / 1e9
        except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on (an OOM at 64k, say)
            entry = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        row[name] = entry
        print(f"attention {seq:>6} tokens {name:28s} {_fmt(entry)}", flush=True)
    stock = row["stock sdpa"]
    if "fwd_bwd_ms" in stock:
        row["ratios"] = {
            name: {"fwd": e["fwd_ms"] / stock["fwd_ms"], "fwd_bwd": e["fwd_bwd_ms"] / stock["fwd_bwd_ms"]}
            for name, e in row.items()
            if "fwd_bwd_ms" in e and name != "stock sdpa"
        }
    return row


def _fmt(entry: dict) -> str:
    if "error" in entry:
        return f"FAILED {entry['error'][:120]}"
    return (f"fwd {entry['fwd_ms']:9.3f} ms  fwd+bwd {entry['fwd_bwd_ms']:9.3f} ms  "
            f"rel vs stock {entry['rel_vs_stock']:.1e}")  # fmt: skip


# ------------------------------------------------------------------------------------------------ Wan forward
class _Attend:
    """A Wan self-attention processor with the stock arithmetic attending through ``attend(q, k, v)`` on
    ``[B, S, H, D]``: what each rank of hfpatch's sequence split computes, without the communication."""

    def __init__(self, attend) -> None:
        self.attend = attend

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from hfpatch.patches.wan_attention import wan_self_attention_qkv

        q, k, v = wan_self_attention_qkv(attn, hidden_states, rotary_emb)
        out = self.attend(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def build_wan(args, device, dtype):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**(WAN_TINY if args.tiny else WAN_1_3B))
    return _to_dtype(model, dtype).eval().requires_grad_(False)


def wan_forward(args, device, dtype, result, model) -> None:
    from hfpatch.attention import ring_attention, usp_attention

    cfg = model.config
    frames, h, w, text = (6, 8, 8, 8) if args.tiny else (21, 60, 104, 512)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, cfg.in_channels, frames, h, w, generator=gen).to(device, dtype)
    prompt = torch.randn(1, text, cfg.text_dim, generator=gen).to(device, dtype)
    t = torch.tensor([500.0], device=device)
    result.update(tokens=frames * h * w // 4, params=sum(p.numel() for p in model.parameters()))
    stock = [b.attn1.processor for b in model.blocks]
    variants = {
        "stock": None,
        "usp degree 1 (sdpa)": lambda q, k, v: usp_attention(q, k, v, ulysses_group=None, ring_group=None)[0],
        "ring path (auto lse kernel)": lambda q, k, v: ring_attention(q, k, v, group=None)[0],
    }
    with torch.no_grad():
        ref = model(x, t, prompt).sample
        for name, attend in variants.items():
            try:
                for block, processor in zip(model.blocks, stock):
                    block.attn1.set_processor(processor if attend is None else _Attend(attend))
                out = model(x, t, prompt).sample
                result[name] = {
                    "ms": timed(lambda: model(x, t, prompt), device, 1, args.repeats),
                    "rel_vs_stock": rel(out, ref),
                }
            except Exception as error:  # noqa: BLE001
                result[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            finally:
                for block, processor in zip(model.blocks, stock):
                    block.attn1.set_processor(processor)
            print(f"wan forward {name:30s} {result[name]}", flush=True)


# ------------------------------------------------------------------------------------------------ streaming
def streaming(args, device, dtype, result, model) -> None:
    from diffusers import AutoencoderKLWan

    import hfpatch
    from hfpatch.streaming import StreamingConfig, StreamingWanPipeline

    torch.manual_seed(0)
    with torch.device(device):
        vae = (AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
               if args.tiny else AutoencoderKLWan())  # fmt: skip
    vae = _to_dtype(vae, dtype).eval().requires_grad_(False)
    text = 8 if args.tiny else 512
    prompt = torch.randn(1, text, model.config.text_dim, generator=torch.Generator().manual_seed(2)).to(
        device, dtype
    )
    height, width = (64, 64) if args.tiny else (480, 832)
    blocks = 5 if args.tiny else 10
    modes = {"": {}, "compiled: ": dict(compile=True, compile_backend=args.compile_backend)}
    if device.type == "cuda":
        modes["compiled + CUDA graphs: "] = dict(compile=True, compile_backend="inductor", cuda_graphs=True)
    # (output type, overlap_decode): the transformer alone, the decode after it, the decode on a side stream.
    runs = {
        "transformer only": ("latent", False),
        "with VAE decode": ("pt", False),
        "with VAE decode, overlapped": ("pt", True),
    }
    for mode, options in modes.items():
        config = StreamingConfig(num_frame_per_block=3, local_attn_size=12, sink_size=3, **options)
        patch = hfpatch.apply(model, streaming=config)
        pipe = StreamingWanPipeline(model, vae, config, 1000, patch)
        try:
            if options:  # compile every kind of block before timing (the warm-up blocks compile graphs)
                warm = pipe.stream(prompt, blocks, height, width, STEPS, generator=torch.Generator().manual_seed(0),
                                   output_type="latent")  # fmt: skip
                for _ in warm:
                    pass
            for run, (output_type, overlap) in runs.items():
                times = []
                sync(device)
                start = time.perf_counter()
                gen = torch.Generator().manual_seed(0)  # a CPU generator drives the noise on any device
                stream = pipe.stream(prompt, blocks, height, width, STEPS, generator=gen, output_type=output_type,
                                     overlap_decode=overlap)  # fmt: skip
                for _ in stream:
                    sync(device)
                    times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                steady = statistics.median(times[4:])  # the window (12 frames) is full from block 5 on
                pixel_frames = 4 * config.num_frame_per_block  # Wan 2.1 VAE: 4 pixel frames per latent frame
                result[mode + run] = {
                    "blocks": blocks, "block_ms": [1e3 * s for s in times], "steady_block_ms": 1e3 * steady,
                    "pixel_frames_per_s": pixel_frames / steady, "cache_bytes": pipe.cache.nbytes,
                    "end_to_end_ms": 1e3 * sum(times),
                }  # fmt: skip
                print(f"streaming {mode}{run}: steady block {1e3 * steady:.1f} ms, "
                      f"{pixel_frames / steady:.1f} px frames/s", flush=True)  # fmt: skip
        finally:
            patch.remove()


# ------------------------------------------------------------------------------------------------ streaming, N GPUs
def streaming_sp(args, device, dtype, result) -> None:
    import socket

    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    cpu_ranks = args.sp_ranks if device.type == "cpu" else None
    if gpus < 2 and not cpu_ranks:
        result["skipped"] = (
            f"the sharded stream needs at least 2 GPUs on this machine; found {gpus} "
            f"({'CPU run' if device.type == 'cpu' else torch.cuda.get_device_name(device)}): nothing to split"
        )
        print(f"streaming_sp: {result['skipped']}", flush=True)
        return
    worlds = [cpu_ranks] if cpu_ranks else [n for n in (2, 4, 8) if n <= gpus]
    ctx = mp.get_context("spawn")
    for world in worlds:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_streaming_sp_rank, args=(rank, world, port, args.tiny, str(dtype), queue))
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        try:
            rows = queue.get(timeout=max(60.0, args.budget_s))
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
        if isinstance(rows, str):
            raise RuntimeError(f"parallel={world}: {rows}")
        result[f"N={world}"] = rows
        print(f"streaming_sp N={world}: {rows}", flush=True)


def _streaming_sp_rank(rank: int, world: int, port: int, tiny: bool, dtype_name: str, queue) -> None:
    """One rank of :func:`streaming_sp` (spawned): the stream of :func:`streaming` split over ``world`` ranks."""
    import os
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel

        import hfpatch
        from hfpatch import ParallelConfig
        from hfpatch.streaming import StreamingConfig, StreamingWanPipeline

        dtype = getattr(torch, dtype_name.split(".")[-1])
        torch.manual_seed(0)
        with torch.device(device):
            model = WanTransformer3DModel(**(WAN_TINY if tiny else WAN_1_3B))
            vae = (AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                    latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
                   if tiny else AutoencoderKLWan())  # fmt: skip
        model = _to_dtype(model, dtype).eval().requires_grad_(False)
        vae = _to_dtype(vae, dtype).eval().requires_grad_(False)
        config = StreamingConfig(num_frame_per_block=3, local_attn_size=12, sink_size=3)
        patch = hfpatch.apply(model, parallel=world, streaming=config)
        plan = ParallelConfig(ring=patch.plan.ring, ulysses=patch.plan.ulysses)
        vae_patch = hfpatch.apply(vae, parallel=ParallelConfig(vae=world))
        pipe = StreamingWanPipeline(model, vae, config, 1000, patch, plan, vae_patch)
        text = 8 if tiny else 512
        prompt = torch.randn(1, text, model.config.text_dim, generator=torch.Generator().manual_seed(2)).to(
            device, dtype
        )
        height, width = (64, 64) if tiny else (480, 832)
        blocks = 5 if tiny else 10
        rows = {"plan": repr(plan)}
        for run, output_type in (("transformer only", "latent"), ("with VAE decode (split)", "pt")):
            times = []
            sync(device)
            start = time.perf_counter()
            stream = pipe.stream(prompt, blocks, height, width, STEPS, generator=torch.Generator().manual_seed(0),
                                 output_type=output_type)  # fmt: skip
            for _ in stream:
                sync(device)
                times.append(time.perf_counter() - start)
                start = time.perf_counter()
            steady = statistics.median(times[4:])  # the window (12 frames) is full from block 5 on
            pixel_frames = 4 * config.num_frame_per_block
            rows[run] = {"block_ms": [1e3 * t for t in times], "steady_block_ms": 1e3 * steady,
                         "pixel_frames_per_s": pixel_frames / steady,
                         "cache_bytes_per_rank": pipe.cache.nbytes}  # fmt: skip
        pipe.remove()
        if rank == 0:
            queue.put(rows)
    except Exception:  # noqa: BLE001 - reported to the parent, which records the section's error
        if rank == 0:
            queue.put(traceback.format_exc()[-1500:])
        raise
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ pixel loss
def pixel_loss(args, device, dtype, result) -> None:
    from diffusers import AutoencoderKL

    from hfpatch.training import chunked_pixel_loss

    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKL(**(KL_TINY if args.tiny else FLUX_VAE))
    vae = _to_dtype(vae, dtype).eval().requires_grad_(False)
    size = 8 if args.tiny else 128
    pixels = size * 2 ** (len(vae.config.block_out_channels) - 1)
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(4, vae.config.latent_channels, size, size, generator=gen).to(device, dtype)
    targets = (torch.rand(4, 3, pixels, pixels, generator=gen) * 2 - 1).to(device, dtype)
    result.update(image=pixels, dtype=str(dtype))
    cases = {
        "one-shot batch 1": (1, dict(reference=True)),
        "one-shot batch 2": (2, dict(reference=True)),
        "hfpatch chunk 1, batch 4": (4, dict(chunk_size=1)),
    }
    for name, (batch, options) in cases.items():

        def step(batch=batch, options=options):
            leaf = latents[:batch].detach().clone().requires_grad_()
            chunked_pixel_loss(vae, leaf, targets[:batch], **options).backward()

        try:
            step()  # warm-up (kernels, allocator)
            result[name] = {
                "step_peak_gib": peak_bytes(step, device) / GiB,
                "ms": timed(step, device, 0, args.repeats),
            }
        except Exception as error:  # noqa: BLE001
            result[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(f"pixel loss {name:26s} {result[name]}", flush=True)


# ------------------------------------------------------------------------------------------------ GradCache
def gradcache(args, device, dtype, result) -> None:
    from transformers import BertConfig, BertModel

    from hfpatch.training import GradCache, InfoNCELoss

    if args.tiny:
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64)  # fmt: skip
        batch, seq, chunks = 16, 16, (4, 8)
    else:
        config = BertConfig()  # BERT-base
        batch, seq, chunks = 256, 128, (32, 64)
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False).to(device).train()
    gen = torch.Generator().manual_seed(0)
    inputs = [{"input_ids": torch.randint(5, config.vocab_size, (batch, seq), generator=gen).to(device),
               "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device)} for _ in range(2)]  # fmt: skip
    autocast = (
        torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    )

    def info_nce(q, p):
        logits = F.normalize(q.float(), dim=-1) @ F.normalize(p.float(), dim=-1).T * 20.0
        return F.cross_entropy(logits, torch.arange(len(q), device=q.device))

    def mean_pool(out, chunk):
        mask = chunk["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)
        return (out.last_hidden_state * mask).sum(1) / mask.sum(1)

    def plain():
        with autocast:
            loss = info_nce(*(mean_pool(model(**x), x) for x in inputs))
        loss.backward()

    steps = {"plain": plain}
    for chunk in chunks:
        cache = GradCache(model, info_nce, chunk_size=chunk, rep_fn=mean_pool,
                          autocast_dtype=None if dtype == torch.float32 else dtype)  # fmt: skip
        steps[f"gradcache chunk {chunk}"] = lambda cache=cache: cache.step(*inputs)
        compiled = GradCache(model, info_nce, chunk_size=chunk, rep_fn=mean_pool, compile=True,
                             compile_backend=args.compile_backend,
                             autocast_dtype=None if dtype == torch.float32 else dtype)  # fmt: skip
        steps[f"gradcache chunk {chunk}, compiled"] = lambda cache=compiled: cache.step(*inputs)
    # The same InfoNCE computed in row blocks (hfpatch.training.InfoNCELoss) at the largest chunk, compiled.
    blocked = GradCache(model, InfoNCELoss(20.0), chunk_size=chunks[-1], rep_fn=mean_pool, compile=True,
                        compile_backend=args.compile_backend,
                        autocast_dtype=None if dtype == torch.float32 else dtype)  # fmt: skip
    steps[f"gradcache chunk {chunks[-1]}, compiled, row-blocked loss"] = lambda: blocked.step(*inputs)
    result.update(batch=batch, seq=seq, dtype=str(dtype))
    for name, step in steps.items():
        try:
            model.zero_grad(set_to_none=False)
            result[name] = {
                "ms": timed(step, device, 1, args.repeats),
                "step_peak_gib": peak_bytes(step, device) / GiB,
            }
        except Exception as error:  # noqa: BLE001
            result[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    plain_ms = result["plain"].get("ms")
    for name in steps:
        if plain_ms and "ms" in result[name]:
            result[name]["time_vs_plain"] = result[name]["ms"] / plain_ms
        print(f"gradcache {name:22s} {result[name]}", flush=True)
    # The loss stage alone at CLIP scale: a global batch of 32,768 pairs, width 768, CLIP's loss (learned
    # temperature) on given embeddings, forward + backward: row-blocked (default 256 MiB budget) vs the whole
    # matrix through autograd.
    from hfpatch.training import CLIPLoss

    pairs, width = (512, 32) if args.tiny else (32768, 768)
    reps = [torch.randn(pairs, width, generator=gen).to(device, dtype) for _ in range(2)]

    def clip_stage(loss_fn):
        leaves = [r.detach().requires_grad_() for r in reps]
        loss_fn(*leaves).backward()

    scale = torch.tensor(1 / 0.07, device=device)

    def unchunked(i, t, fp32=False):
        with autocast if not fp32 else contextlib.nullcontext():
            if fp32:
                i, t = i.float(), t.float()
            logits = scale * F.normalize(i, dim=-1) @ F.normalize(t, dim=-1).T
            labels = torch.arange(len(i), device=device)
            return (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2

    # CLIPLoss computes in fp32 whatever the embeddings' dtype (autocast off inside): the fp32 whole-matrix row is
    # its like-for-like reference; the bf16-autocast row is what a stock script's loss does.
    stages = {
        "clip loss stage, row-blocked (fp32)": CLIPLoss().to(device),
        "clip loss stage, unchunked (bf16 autocast)": unchunked,
        "clip loss stage, unchunked (fp32)": functools.partial(unchunked, fp32=True),
    }
    result["loss_stage"] = {"pairs": pairs, "width": width}
    for name, loss_fn in stages.items():
        try:
            result["loss_stage"][name] = {
                "ms": timed(lambda f=loss_fn: clip_stage(f), device, 1, args.repeats),
                "peak_gib": peak_bytes(lambda f=loss_fn: clip_stage(f), device) / GiB,
            }
        except Exception as error:  # noqa: BLE001 (the unchunked stage may not fit)
            result["loss_stage"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(f"gradcache {name:30s} {result['loss_stage'][name]}", flush=True)


# ------------------------------------------------------------------------------------------------ plot + main
def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width
    fig, axes = plt.subplots(4, 1, figsize=(9, 17.2))
    rows = result.get("attention", {}).get("rows", {})
    for ax, key, title in (
        (axes[0], "fwd_ms", "attention forward"),
        (axes[1], "fwd_bwd_ms", "attention fwd+bwd"),
    ):
        names = sorted({n for row in rows.values() for n, e in row.items() if key in e})
        for name in names:
            pts = [(int(s), row[name][key]) for s, row in rows.items() if key in row.get(name, {})]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms", title=title)
        ax.legend()
    wan = {n: e["ms"] for n, e in result.get("wan_forward", {}).items() if isinstance(e, dict) and "ms" in e}
    axes[2].bar(list(wan), list(wan.values()))
    axes[2].set(ylabel="ms", title=f"Wan forward ({result.get('wan_forward', {}).get('tokens')} tokens)")
    axes[2].tick_params(axis="x", labelrotation=15, labelsize=7)
    fps = {
        n: e["pixel_frames_per_s"]
        for n, e in result.get("streaming", {}).items()
        if isinstance(e, dict) and "pixel_frames_per_s" in e
    }
    for world, runs in result.get("streaming_sp", {}).items():  # the sharded stream, when it ran
        if isinstance(runs, dict):
            fps.update(
                {f"{world} {n}": e["pixel_frames_per_s"] for n, e in runs.items() if isinstance(e, dict)}
            )
    axes[3].bar(list(fps), list(fps.values()))
    axes[3].set(ylabel="pixel frames / s", title="streaming Wan")
    fig.suptitle(
        f"hfpatch on {result['env'].get('gpu', result['env']['device'])}, torch {result['env']['torch']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SECTIONS = ("attention", "wan_forward", "streaming", "streaming_sp", "pixel_loss", "gradcache")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (seconds; what the tests run)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="start no section after this many seconds"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--name", default=None, help="results file name (default gpu, or gpu_tiny with --tiny)"
    )
    parser.add_argument(
        "--sp-ranks",
        type=int,
        default=None,
        help="run the streaming_sp section on this many gloo CPU ranks (with --device cpu; default: skip on CPU)",
    )
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of the compiled rows (default: inductor; eager with --tiny, seconds)",
    )
    args = parser.parse_args(argv)
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.tiny else "inductor"
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    name = args.name or ("gpu_tiny" if args.tiny else "gpu")
    result = {"env": environment(device), "tiny": args.tiny, "dtype": str(dtype)}
    start = time.perf_counter()
    model = None
    for section in args.sections.split(","):
        if section not in SECTIONS:
            raise SystemExit(f"unknown section {section!r}; known: {', '.join(SECTIONS)}")
        part = result[section] = {}
        if time.perf_counter() - start > args.budget_s:
            part["skipped"] = f"time budget of {args.budget_s:.0f} s spent"
            continue
        t0 = time.perf_counter()
        try:
            if section in ("wan_forward", "streaming"):
                model = build_wan(args, device, dtype) if model is None else model
                globals()[section](args, device, dtype, part, model)
            else:
                globals()[section](args, device, dtype, part)
        except Exception as error:  # noqa: BLE001 - one failing section must not lose the others
            part["error"] = f"{type(error).__name__}: {error}"
            part["where"] = traceback.format_exc()[-1500:]
            print(f"SECTION {section} FAILED: {part['error']}", flush=True)
        part["seconds"] = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # Written after every section: a run stopped at its time limit keeps what it measured.
        result["seconds"] = time.perf_counter() - start
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out / f"{name}.png")
    print(f"wrote {args.out / (name + '.json')} in {result['seconds']:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
