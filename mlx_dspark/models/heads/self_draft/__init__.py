"""Self-speculation (LayerSkip / Draft & Verify): the target's own first N layers, its final norm and its head
drafting for it (`model`). No weights of its own: the draft's rows of layers 0 .. N - 1 are the target's."""
