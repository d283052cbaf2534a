"""`python -m mlx_dspark.export`: the command line lives in `mlx_dspark.cli.export`."""

from mlx_dspark.cli.export import main

if __name__ == "__main__":
    main()
