"""`python -m mlx_dspark.train`: see mlx_dspark/train/cli.py."""

from mlx_dspark.train.cli import train_app

if __name__ == "__main__":
    train_app()
