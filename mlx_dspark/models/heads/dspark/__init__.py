"""Block drafts: DSpark / DFlash (`model`, `args`), DFlash 2 (`dflash2`, `dflash2_args`), the Markov and confidence heads (`markov`), how a published draft is packaged (`packaging`) and a block's tree distributions (`tree`)."""

from mlx_dspark.models.heads.dspark.dflash2 import draft_class  # noqa: E402,F401  (the block draft a config builds)
