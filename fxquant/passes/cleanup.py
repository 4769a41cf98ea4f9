"""cleanup: drop dead nodes, keeping every node that writes memory (a KV cache's index_copy_ has no users).

The unused parameter placeholders stay: they are the calling convention.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

from fxquant.passes.order import FxquantPass
from fxquant.passes.side_effects import eliminate_dead_code


class Cleanup(FxquantPass):
    name = "cleanup"
    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = eliminate_dead_code(gm.graph)
        return PassResult(gm, modified)
