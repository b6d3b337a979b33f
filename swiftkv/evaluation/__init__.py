"""Quality evaluation: lm-eval on offline copies of the paper's benchmarks."""
