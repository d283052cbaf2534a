"""`python -m mlx_dspark.server`: the command line lives in `mlx_dspark.cli.server`."""

from mlx_dspark.cli.server import main

if __name__ == "__main__":
    main()
