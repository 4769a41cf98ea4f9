"""The command line: `python -m fxquant quantize SOURCE TARGET --recipe int4_wo`, `python -m fxquant inspect PATH`."""

from __future__ import annotations

import argparse
import sys

from fxquant.config import KEEP, RECIPES

EXAMPLES = """examples:
  python -m fxquant quantize ./Llama-3.1-8B ./Llama-3.1-8B-int4 --recipe int4_sym_wo --device cuda
  python -m fxquant quantize ./model ./model-fp8 --recipe fp8_row --skip 'mlp\\.down_proj' --report
  python -m fxquant quantize ./model ./model-int4 --recipe int4_sym_wo --layer-recipe down_proj=fp8_row lm_head=int8_wo
  python -m fxquant inspect ./Llama-3.1-8B-int4
"""


def layer_recipe(text: str) -> tuple[str, str]:
    """REGEX=RECIPE as a layer_recipes entry; split at the last '=', which no recipe's name holds."""
    pattern, sep, recipe = text.rpartition("=")
    if not sep or not pattern or recipe not in (*RECIPES, KEEP):
        raise argparse.ArgumentTypeError(f"{text!r}: give REGEX=RECIPE, RECIPE one of {', '.join(RECIPES)} or {KEEP}")
    return pattern, recipe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxquant", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Quantize transformers checkpoints into compressed-tensors ones, "
                                                 "and see what a checkpoint holds.")
    commands = parser.add_subparsers(dest="command", required=True)
    quantize = commands.add_parser("quantize", help="a transformers checkpoint folder in, a compressed-tensors one out",
                                   description="Quantize the checkpoint in SOURCE (config.json and safetensors) and "
                                               "write it to TARGET, which vLLM, SGLang and fxquant.load_quantized "
                                               "load, and plain transformers for every recipe but int4_wo. A dense "
                                               "model is read one safetensors file at a time; others are loaded whole.")
    quantize.add_argument("source", help="folder of a transformers checkpoint")
    quantize.add_argument("target", help="folder to write (created)")
    quantize.add_argument("--recipe", default="fp8_block", choices=list(RECIPES), help="default: %(default)s")
    quantize.add_argument("--skip", nargs="*", default=[], metavar="REGEX", help="layers to keep in high precision "
                          "(lm_head is kept by default)")
    quantize.add_argument("--include", nargs="*", metavar="REGEX", help="quantize only the layers these match")
    quantize.add_argument("--layer-recipe", nargs="*", default=[], type=layer_recipe, metavar="REGEX=RECIPE",
                          help=f"the layers REGEX matches take RECIPE (or {KEEP}: kept), the first match winning; "
                               "naming lm_head quantizes it")
    quantize.add_argument("--device", default="cpu", help="where to quantize: cpu or cuda (default: %(default)s)")
    quantize.add_argument("--report", action="store_true", help="print the per-layer report")
    quantize.add_argument("--no-progress", action="store_true", help="no progress bar")
    inspect = commands.add_parser("inspect", help="a checkpoint's layers, formats and bytes",
                                  description="List a checkpoint's layers, their formats and bytes, from its "
                                              "config.json and safetensors headers; no tensor is loaded.")
    inspect.add_argument("path", help="folder of a checkpoint (quantized or not)")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        from fxquant.io.checkpoint_info import summary

        print(summary(args.path))
        return 0
    from fxquant.io.convert import quantize_checkpoint

    options = {"recipe": args.recipe, "skip": args.skip, "report": args.report,
               "layer_recipes": dict(args.layer_recipe)}
    if args.include is not None:
        options["include"] = args.include
    how = quantize_checkpoint(args.source, args.target, options, device=args.device,
                              progress=False if args.no_progress else None)
    print(f"fxquant: {args.source} quantized under {args.recipe} ({how}) and written to {args.target}; "
          f"fxquant.load_quantized({str(args.target)!r}, device='cuda') loads it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
