"""The run's configuration: schemas (every dataclass Hydra composes onto), validation (the
typed config and its checks) and resolvers (the YAML's custom resolvers, the ConfigStore)."""
