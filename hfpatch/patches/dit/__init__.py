"""DiT transformers (diffusers): sequence parallelism (USP) for every class with a plan, one family for all.

Patches a diffusers transformer whose class has a row in :data:`PLANS`: the sequence is cut and gathered where
the row (or the class's own ``_cp_plan``, translated) says, and the stock attention processors are routed
through Ulysses/Ring. Exports the table (:data:`PLANS`, :data:`UNSUPPORTED`), its row types
(:class:`DiTPlan`, :class:`AttentionRoute`), the family (:class:`PlannedDiTUSP`), the stand-in processors and
the ``_cp_plan`` translation.
"""

from .family import PlannedDiTUSP, plan_from_cp, plan_source
from .plans import PLANS, UNSUPPORTED
from .processors import USPDispatchProcessor, USPSDPAProcessor
from .vocabulary import AttentionRoute, DiTPlan

__all__ = [
    "PLANS",
    "UNSUPPORTED",
    "AttentionRoute",
    "DiTPlan",
    "PlannedDiTUSP",
    "USPDispatchProcessor",
    "USPSDPAProcessor",
    "plan_from_cp",
    "plan_source",
]
