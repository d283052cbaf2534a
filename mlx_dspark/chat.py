"""`python -m mlx_dspark.chat`: the command line lives in `mlx_dspark.cli.chat`."""

from mlx_dspark.cli.chat import main

if __name__ == "__main__":
    main()
