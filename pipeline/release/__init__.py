"""What leaves the run folder: bundles and their manifests, signatures, archives, compile
caches, sweeps and releases."""
