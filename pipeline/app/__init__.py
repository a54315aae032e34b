"""What a user runs: the `parity`, `parity-bundle` and `parity-release` entry points, the
stage runner and precision=auto."""
