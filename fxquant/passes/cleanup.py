"""cleanup: drop dead nodes (the unused parameter placeholders stay: they are the calling convention)."""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult


class Cleanup(PassBase):
    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = gm.graph.eliminate_dead_code()
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)
