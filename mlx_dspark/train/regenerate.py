"""`python -m mlx_dspark.train.regenerate`: the command line lives in `mlx_dspark.cli.regenerate`; the
regeneration itself in `mlx_dspark.train.distill`."""

from mlx_dspark.cli.regenerate import regenerate_app

if __name__ == "__main__":
    regenerate_app()
