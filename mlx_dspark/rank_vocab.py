"""`python -m mlx_dspark.rank_vocab`: the command line lives in `mlx_dspark.cli.rank_vocab`."""

from mlx_dspark.cli.rank_vocab import main

if __name__ == "__main__":
    main()
