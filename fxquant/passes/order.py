"""What each pass needs to have run before it, checked rather than only stated in its docstring.

A pass that reads detect's annotations (upcast, quantize_linear, fuse_norm) finds nothing to do on a graph detect has
not annotated, and would return modified=False in silence. Each pass names itself and the passes it needs; running it
records its name on the graph (`gm.meta`), and a pass whose needs are not recorded there refuses, naming them and the
fix. The passes that match fxquant's own ops (merge_linear, fuse_linear, pack_lanes) need nothing: a graph built
by hand with those ops, or traced from a quantize_'d model, is theirs to rewrite. To run the
pipeline up to a pass, `fxquant.compile.pipeline.run_pipeline(gm, config, example_inputs, stop_after=name)`.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

RAN_KEY = "fxquant_passes_ran"  # in gm.meta: the names of the passes run on this graph, in order


class PassOrderError(RuntimeError):
    """A pass was run on a graph where a pass it needs has not run."""


def passes_run(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    return tuple(gm.meta.get(RAN_KEY, ()))


class FxquantPass(PassBase):
    """A pass of the pipeline: `name` is how the pipeline and the errors call it; `needs`, the passes that must have
    run on the graph before it; `optional`, whether the option `disable_passes` may leave it out (a pass that only
    fuses or packs: the graph computes the same products without it). A pass returns whether it changed the graph;
    calling it lints and recompiles the graph where it did."""

    name: str = ""
    needs: tuple[str, ...] = ()
    optional: bool = False

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        missing = [need for need in self.needs if need not in passes_run(graph_module)]
        if missing:
            raise PassOrderError(
                f"fxquant: pass {self.name} needs {', '.join(missing)} to have run on this graph first (ran: "
                f"{', '.join(passes_run(graph_module)) or 'none'}). Fix: run those passes first, or the pipeline up "
                f"to this one: fxquant.compile.pipeline.run_pipeline(gm, config, example_inputs, "
                f"stop_after={self.name!r})")

    def __call__(self, graph_module: torch.fx.GraphModule) -> PassResult:
        result = super().__call__(graph_module)
        if result.modified:
            # Only a changed graph is checked and its code regenerated: torch's PassManager recompiles after every
            # pass, which took 4.0 of a 32-layer pipeline's 7.5 s
            # (docs/decisions/0013-pipeline-recompiles-only-changed-graphs.md).
            result.graph_module.graph.lint()
            result.graph_module.recompile()
        result.graph_module.meta[RAN_KEY] = (*passes_run(graph_module), self.name)
        return result
