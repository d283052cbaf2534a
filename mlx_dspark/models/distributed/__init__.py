"""A target split over the ranks of an mx.distributed group (`split_target`): tensor or pipeline parallel with mlx-lm's own methods, the lead / follow protocol of each forward."""
