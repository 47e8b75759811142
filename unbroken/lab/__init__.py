"""Tools that run the product and measure it: benchmarks, chaos campaigns and run reports."""
