"""fedhead: federated fine-tuning of linear heads on frozen foundation-model features.

The Python API (imported on first use, so ``import fedhead`` stays light):

- :func:`run` (``fedhead.federation.api.run``): run a :class:`TrainConfig` (or its fields as keywords, or an
  experiment file), get the summary and per-round rows;
- :class:`FeatureStore`: features that come from elsewhere (``FeatureStore.from_arrays(X, y, X_test, y_test)``,
  another pipeline's embeddings), which :func:`run` takes as ``features=``, with the content hash of the store
  written from them (``fedhead import`` writes one from ``.npy``/``.npz``/Parquet files, docs/import.md);
- :func:`register_head`, :class:`Head`, :class:`ClosedFormHead`, :class:`Param`, :class:`LossContext`:
  a head of one's own (a local loss, or a closed-form solve from client statistics); :class:`Interval` and
  :class:`OneOf`, the constraints a :class:`Param` declares; :class:`StatsAccumulator`, what a closed-form head's
  ``solve`` receives;
- :func:`register_aggregator`, :class:`Aggregator`, :class:`Totals`: an aggregation rule of one's own (what a
  client sends after local training, and what the server makes of the sum), ``--aggregate NAME``;
- :func:`register_server_optimizer`, :class:`ServerOptimizer`: a server update of one's own that keeps state
  across rounds (``--server-opt NAME``), checkpointed with the run;
- :func:`register_personal`, :class:`Personalizer`: a personalisation method of one's own (``--personalize
  NAME``; its ``how`` says which kind of personal head it makes, docs/personalization.md);
- :func:`register_method`: a named set of training options for ``fedhead bench baselines``;
- :func:`load_model`: a run's model (``model-seed<S>.json`` + ``.safetensors``) with scikit-learn's ``classes_``,
  ``predict`` and ``predict_proba`` on features or images (docs/model.md);
- :func:`update_model`, :func:`forget_model`, :func:`client_statistics_file`: take clients into or out of a
  closed-form model that kept its statistics, exactly (``fedhead update`` / ``fedhead forget``, docs/lifecycle.md).
"""

__version__ = "0.1.0"

_API = {
    "run": ("fedhead.federation.api", "run"),
    "FeatureStore": ("extract.arrays", "FeatureStore"),
    "TrainConfig": ("fedhead.federation.config", "TrainConfig"),
    "register_head": ("fedhead.core.heads", "register_head"),
    "Head": ("fedhead.core.heads", "Head"),
    "LossContext": ("fedhead.core.heads", "LossContext"),
    "ClosedFormHead": ("fedhead.core.closedform", "ClosedFormHead"),
    "Param": ("fedhead.infra.params", "Param"),
    "Interval": ("fedhead.infra.errors", "Interval"),
    "OneOf": ("fedhead.infra.errors", "OneOf"),
    "StatsAccumulator": ("fedhead.core.closedform", "StatsAccumulator"),
    "register_method": ("fedhead.federation.methods", "register_method"),
    "register_aggregator": ("fedhead.core.aggregate", "register_aggregator"),
    "Aggregator": ("fedhead.core.aggregate", "Aggregator"),
    "Totals": ("fedhead.core.aggregate", "Totals"),
    "ServerOptimizer": ("fedhead.core.serveropt", "ServerOptimizer"),
    "load_model": ("fedhead.federation.model", "load_model"),
    "update_model": ("fedhead.federation.versions", "update_model"),
    "forget_model": ("fedhead.federation.versions", "forget_model"),
    "client_statistics_file": ("fedhead.federation.versions", "client_statistics_file"),
    "register_server_optimizer": ("fedhead.core.serveropt", "register_server_optimizer"),
    "register_personal": ("fedhead.core.personal", "register_personal"),
    "Personalizer": ("fedhead.core.personal", "Personalizer"),
}
__all__ = sorted(_API)


def __dir__() -> list[str]:
    """``dir(fedhead)``: the public API (imported on first use, so not yet in the module's namespace) with the rest."""
    return sorted(set(globals()) | set(_API))


def __getattr__(name: str):
    if name in _API:
        import importlib

        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fedhead' has no attribute {name!r}")
