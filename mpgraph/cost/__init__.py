"""The cost model's inputs and solver: device specs (named GPUs, a measured CPU) and the
minimum cut that places precisions."""
