"""One module per client API: each converts its request in and its answer out around the
pipeline."""
