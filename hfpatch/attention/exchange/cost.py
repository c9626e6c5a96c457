"""What the Ulysses exchange costs at the least: the bytes one attention call copies, and those it sends.

Copies (``e`` bytes per element, ``n_r`` real tokens of this rank's shard, ``H`` heads, ``H_r`` this rank's,
``T`` text tokens): ``e * B * D * (4 n_r H + 3 T H_r + T H)``: one copy of q, k, v and the output, the text
heads of q, k, v into the kernel's buffers and the text output heads into the joined output.
``benchmarks/ulysses_exchange.py`` measures it with :func:`hfpatch.testing.memory.count_copies`; the tests
hold the exchange to it exactly. Bytes sent: ``(u - 1) / u`` of each local tensor, the analytic minimum of
an all-to-all (padding rows are never sent).

>>> copy_minimum(batch=1, local=4, heads=4, local_heads=2, dim=8, text=0, element_size=4)  # 4 x one local q
2048
"""

from __future__ import annotations


def copy_minimum(
    batch: int, local: int, heads: int, local_heads: int, dim: int, text: int, element_size: int
) -> int:
    """Analytic minimum of the bytes one attention call copies: one copy of q, k, v and the output (``local``
    real tokens of this rank, all ``heads``), the ``text`` tokens' heads of q, k, v into the kernel's buffers
    (``local_heads``) and the text output heads into the joined output (module docstring)."""
    return element_size * batch * dim * (4 * local * heads + 3 * text * local_heads + text * heads)
