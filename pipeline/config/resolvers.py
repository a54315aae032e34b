"""The OmegaConf resolvers parity's YAML uses (``parity_asset``: a file shipped in the
package; ``parity_job_folder``: a sweep job's folder name) and the ConfigStore
registration of the schemas."""

from __future__ import annotations

from importlib import resources

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pipeline.config.schemas import TARGET_SCHEMAS, RunConfig


def asset_path(name: str) -> str:
    """Absolute path of a file shipped in pipeline/assets (the embedded default)."""
    return str(resources.files("pipeline") / "assets" / name)


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="parity_schema", node=RunConfig)
    for backend, schema in TARGET_SCHEMAS.items():
        store.store(group="schema/target", name=backend.value, node=schema)
    if not OmegaConf.has_resolver("parity_asset"):
        OmegaConf.register_new_resolver("parity_asset", asset_path)
    if not OmegaConf.has_resolver("parity_job_folder"):
        from pipeline.release.sweep import job_folder

        OmegaConf.register_new_resolver("parity_job_folder", job_folder)
