"""`python -m mlx_dspark.generate`: the command line lives in `mlx_dspark.cli.generate`.

Library code imports `mlx_dspark.api`, never this module: importing it would rebind the package
attribute `mlx_dspark.generate` from the API function to this module.
"""

from mlx_dspark.cli.generate import main

if __name__ == "__main__":
    main()
