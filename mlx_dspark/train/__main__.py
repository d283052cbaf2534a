"""`python -m mlx_dspark.train`: the command line lives in `mlx_dspark.cli.train`."""

from mlx_dspark.cli.train import train_app

if __name__ == "__main__":
    train_app()
