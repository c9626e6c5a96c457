"""A GGUF file's tensors as views of one private mapping of the file: each rank copies only the rows it keeps.

diffusers' ``from_single_file`` with ``GGUFQuantizationConfig`` reads a ``.gguf`` file with
``load_gguf_checkpoint``, which copies every tensor out of the file (``tensor.data.copy()``): each rank then
holds the whole quantized model in its own memory before ``shard_weights`` keeps its 1/N. Under
``hfpatch.from_pretrained(..., single_files={"transformer": "x.gguf"}, shard_weights=True)`` the state dict is
built here instead, as that function builds it (a ``GGUFParameter`` of the same quantization type for each
quantized tensor, a plain tensor for F32/F16), but each tensor a view of a private, copy-on-write mapping of the
file (``GGUFReader(path, mode="c")``): nothing is read until used. diffusers' key conversion renames and
splits tensors as views, ``shard_weights`` copies this rank's rows of each quantized weight
(:class:`hfpatch.patches.fsdp.quantized.QuantizedRows`) and FSDP2 its chunk of each float one, and the mapping is gone
once the model holds only its shards. The ranks compare the file's bytes once per node (the sha256 of
``check_files="full"``) instead of digesting every weight on every rank
(:func:`~hfpatch.distributed.agreement.compared_as_files`), which would read the whole file in every process.

The pages a rank reads stay in the page cache, shared by the ranks of a node, not in the process's own memory.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mapped_gguf_state_dict"]


def mapped_gguf_state_dict(path: str) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """The state dict of the GGUF file ``path`` as diffusers' ``load_gguf_checkpoint`` makes it, each tensor a view
    of one private mapping of the file, and that mapping's address range ``(start, stop)``.

    Raises:
        ValueError: A tensor of a quantization type diffusers' GGUF support does not dequantize (as diffusers).

    .. code-block:: python

        state, (start, stop) = mapped_gguf_state_dict("wan2.1-t2v-14b-Q8_0.gguf")
        transformer = WanTransformer3DModel.from_single_file(state, config=..., quantization_config=...)
    """
    import gguf
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES, GGUFParameter

    reader = gguf.GGUFReader(path, mode="c")  # copy-on-write: writable views for torch, no byte read yet
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    state: dict[str, Any] = {}
    for tensor in reader.tensors:
        quant_type = tensor.tensor_type
        if quant_type not in plain and quant_type not in SUPPORTED_GGUF_QUANT_TYPES:
            raise ValueError(
                f"{path}: {tensor.name} has the quantization type {quant_type.name}, which diffusers' GGUF support "
                f"does not dequantize (it reads {', '.join(t.name for t in SUPPORTED_GGUF_QUANT_TYPES)})"
            )
        weights = torch.from_numpy(tensor.data)  # a view of the mapping
        state[tensor.name] = weights if quant_type in plain else GGUFParameter(weights, quant_type=quant_type)
    start = reader.data.ctypes.data
    return state, (start, start + reader.data.nbytes)
