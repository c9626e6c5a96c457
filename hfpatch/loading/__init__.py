"""``hfpatch.from_pretrained``: load a pipeline so that each rank reads only the weights it keeps.

``hfpatch.apply(pipe, parallel=N, shard_weights=True)`` shards a pipeline that every rank has loaded whole: it
caps hfpatch at models one device (and one host's memory, N times over) can hold. ``hfpatch.from_pretrained``
joins the two steps, so the weights a rank does not keep are never read:

.. code-block:: python

    pipe, patch = hfpatch.from_pretrained("Wan-AI/Wan2.2-T2V-A14B-Diffusers", parallel=8, shard_weights=True,
                                          torch_dtype=torch.bfloat16)   # torchrun --nproc-per-node 8

It reads as the two calls it replaces, ``DiffusionPipeline.from_pretrained(path, torch_dtype=...)`` then
``hfpatch.apply(pipe, parallel=..., **options)``, takes their arguments, and returns both results, the pipeline
and the :class:`~hfpatch.Patch` (one call cannot load a sharded model and leave the sharding for later: the
unsharded model would have to exist first). What happens, on every rank:

1. **Files.** A local folder is read in place. A hub id is downloaded once per node: the node's local rank 0
   calls ``DiffusionPipeline.download`` (diffusers' own choice of files), the node's other ranks wait for it
   (``HFPATCH_DOWNLOAD_TIMEOUT_S``, default 4 h) and then resolve the same snapshot from the cache without the
   network (``local_files_only=True``).
2. **Plan.** The pipeline is assembled with its models on the ``meta`` device (nothing read); the plan ``apply``
   will use is resolved, and it says which models are read in part: with ``shard_weights``, the models FSDP2
   shards (the denoisers and the transformers encoders, :func:`hfpatch.patches.fsdp.sharded_models`); under
   PipeFusion (with ``pipefusion_release_weights``, its default), the transformer, of which each stage keeps its
   blocks. Everything else (VAE, schedulers, tokenizers, encoders under PipeFusion) is loaded the usual way.
3. **Checks, before any collective.** For each model read in part: its safetensors files (an index and its
   shards, or one file) exist and hold every tensor the index names; every parameter of the model is in them
   with its shape, floating point (a quantized checkpoint is refused by name); the bytes this rank will hold
   (its FSDP2 shards, padding included, or its stage) plus the replicated components and the largest tensor fit
   the memory available (the node's ``MemAvailable`` over its ranks; the GPU's free memory for shards on a GPU).
   A digest of what each rank reads (``model_index.json``, every config and tokenizer file, each safetensors
   header and file size, and three 4 KiB windows of each file's data) is compared over the ranks. All of it goes
   through one handshake over the default group's store, so a problem on one rank raises the same
   :class:`LoadError`, listing every rank's problem, on every rank; nothing has been read then, and no process
   group of hfpatch's exists. Then (``check_files="full"``, the default) every byte of every safetensors file
   read in part is compared: the sha256 of each file, computed once per node (its ranks split the files), is
   exchanged and compared file by file, so a rank that reads another revision or a copy that differs anywhere
   (a partial rsync, a re-saved shard) raises the same :class:`LoadError` on every rank, naming the file
   (:mod:`hfpatch.loading.files`; about one more read of the checkpoint per node).
4. **Reading.** The models read in part get a :class:`~hfpatch.patches.checkpoint.CheckpointSource` and
   ``hfpatch.apply`` runs: ``shard_weights`` shards each one on ``meta`` with FSDP2 and fills this rank's shards
   with the rows FSDP2 gives it, read from the files alone (one plain read of the rows' bytes into a new tensor, no
   mapping of the file: a rank's resident memory is its shard); PipeFusion reads its stage's blocks and the
   unsplit rest whole. The result is bit-identical to loading whole and then
   sharding: the same dtypes (each library's rules: diffusers' ``_keep_in_fp32_modules``, transformers' dtype
   plan), the same rows, FSDP2's padding zeros.

The models are built as their library builds them in ``from_pretrained`` (diffusers: ``from_config`` under the
dtype as default, ``no_init_weights`` and accelerate's ``init_empty_weights``, which leaves buffers real;
transformers: the model class on its config, its weights tied), so their non-persistent buffers are the
library's. ``patch.remove()`` gathers the full weights back (a collective), as after ``apply``.

LoRA and quantized checkpoints are refused by name. ``pipe.load_lora_weights`` after ``from_pretrained`` raises,
as after ``apply(..., shard_weights=True)``: diffusers sizes the adapter layers from the FSDP2 shards. LoRA layers
added by ``prepare=`` (a callable run on the assembled pipeline before ``apply``) are refused too: the base
weights of the models read in part are not loaded then. To serve a LoRA, fuse it into the base weights
(``pipe.load_lora_weights``, ``pipe.fuse_lora()``, ``pipe.unload_lora_weights()``, ``save_pretrained``) and load
that folder. A checkpoint with a ``quantization_config`` or integer weights is not read in part (refused with
``shard_weights``: FSDP2 shards floating-point parameters only). Quantized models load through diffusers instead
(issue 50): ``quantization_config=`` (a ``PipelineQuantizationConfig``: diffusers quantizes while loading) and
``single_files=`` (a component from one file, a ``.gguf`` through ``GGUFQuantizationConfig``) load those components
whole on every rank, then ``hfpatch.apply`` runs; with ``shard_weights`` their quantized rows are sharded then,
where the kind splits by rows (:mod:`hfpatch.patches.fsdp.quantized`). A ``.gguf`` single file under
``shard_weights`` on several ranks is read through a private mapping of the file instead of diffusers' copy of
every tensor (:mod:`hfpatch.loading.gguf_files`): each rank copies only its rows; the ranks compare the file's
bytes (``check_files="full"``) in place of its tensors' digests.

The package: :mod:`hfpatch.loading.pretrained` (:func:`from_pretrained`, :class:`LoadError`: the steps above, in
order), :mod:`hfpatch.loading.files` (the files a load reads and their agreement over the ranks),
:mod:`hfpatch.loading.models` (the models a pipeline folder names, built on ``meta``) and
:mod:`hfpatch.loading.gguf_files` (a GGUF file's tensors as views of one mapping).
"""

from .pretrained import LoadError, from_pretrained

__all__ = ["LoadError", "from_pretrained"]
