"""A Gemma 4 assistant drafter over the target's last full and sliding layers' K/V (`model`)."""
