"""What `import fxquant` needs: its declared dependencies only."""

import subprocess
import sys
from pathlib import Path


def test_importing_fxquant_needs_no_transformers():
    """transformers is a test dependency only: `import fxquant` and its backend never import it; FP8StaticCache,
    which subclasses its StaticCache, imports it on first use."""
    code = ("import sys, fxquant, fxquant.compile.backend, fxquant.compile.pipeline; "
            "assert 'transformers' not in sys.modules; fxquant.FP8StaticCache; assert 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
