"""`python -m mlx_dspark.benchmark`: the command line lives in `mlx_dspark.cli.benchmark`."""

from mlx_dspark.cli.benchmark import app

if __name__ == "__main__":
    app()
