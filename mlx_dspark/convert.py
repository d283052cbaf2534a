"""`python -m mlx_dspark.convert`: the command line lives in `mlx_dspark.cli.convert`."""

from mlx_dspark.cli.convert import main

if __name__ == "__main__":
    main()
