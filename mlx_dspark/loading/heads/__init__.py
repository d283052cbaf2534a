"""Each draft head's loader, one module per head named as in `models/heads/`: `detect(config)` tells its files apart and `load` builds its module from a checkpoint. Imports models/, never engine/."""
