"""This machine's costs: the cost curve and the confidence schedule over it (`curve`), its measurement at first use cached on disk (`probe`), its correction by observed rounds (`heal`)."""
