"""Draft heads, one folder each (`models/heads/<name>/`: config and model), with the proposer beside it in
`engine/proposers/<name>.py` and the loader in `loading/heads/<name>.py`. `HEADS` is the one list of them;
every room finds a head's module by its name (as mlx-lm finds `mlx_lm.models.<model_type>`)."""
