"""The block draft's loader declarations (DSpark, DFlash, DFlash 2): what tells its files apart. Its build
(shared tensors compared with the target's, the reduced vocabulary, the measured source-precision parts kept
in float) is `loading/load.build_draft`, the pair's default head."""

from __future__ import annotations

from mlx_dspark.models.heads.dspark.args import is_draft_config

DESCRIPTION = "a DSpark / DFlash block draft"
HELP = "a block draft (DSpark, DFlash, DFlash 2)"  # --draft's help


def detect(config: dict) -> bool:
    return is_draft_config(config)
