"""Lossless speculative decoding for any mlx-lm model on Apple Silicon, with MLX.

Draft heads of every published kind, each verified by the target in one forward: block drafts (DSpark,
DFlash, DFlash 2), EAGLE-3 drafts, Gemma 4 assistants, the target's own multi-token-prediction layers, a
small model of the same family (mlx-lm's --draft-model), the target's own first layers (self-speculation),
and prompt lookup; one folder per head, registered once (docs/ARCHITECTURE.md, "Heads"). Greedy
output is plain decoding's, token for token; sampled output follows the target's distribution exactly.
`load`, `generate`, `stream_generate` and `make_prompt_cache` are the API (docs/PYTHON_API.md).

The API functions are imported here, after their modules: a later `import mlx_dspark.load` then finds
the module already loaded and leaves the package attribute `load` bound to the function. The CLI
module `mlx_dspark.generate` is never imported by the library, so `mlx_dspark.generate` stays the
API function.
"""

from __future__ import annotations

from mlx_dspark.api import (
    ContextLengthError,
    GenerationCancelled,
    GenerationResult,
    StepResponse,
    generate,
    make_prompt_cache,
    stream_generate,
)
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.loading.load import LoadedModel, load
from mlx_dspark.engine.options import GenerationOptions, OptionError, SamplingOptions, SpeculationOptions
from mlx_dspark.engine.costs.curve import CostCurve

__version__ = "0.1.0"
__all__ = [
    "ContextLengthError",
    "CostCurve",
    "GenerationCancelled",
    "GenerationOptions",
    "GenerationResult",
    "LoadedModel",
    "OptionError",
    "PromptCache",
    "SamplingOptions",
    "SpeculationOptions",
    "StepResponse",
    "generate",
    "load",
    "make_prompt_cache",
    "stream_generate",
]
