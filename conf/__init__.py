"""parity's Hydra config tree, shipped as package data so the CLI works from a wheel."""
