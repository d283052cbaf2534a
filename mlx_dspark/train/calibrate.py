"""`python -m mlx_dspark.train.calibrate`: the command line lives in `mlx_dspark.cli.train`; the
calibration itself in `mlx_dspark.train.calibration`."""

from mlx_dspark.cli.train import calibrate_app

if __name__ == "__main__":
    calibrate_app()
