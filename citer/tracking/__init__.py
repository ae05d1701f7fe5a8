"""The MLflow side and the records: registry, alias, store, the deployed champion and its τ, report provenance."""
