"""The MLflow side and the records: the registry and its alias, the project's store, the champion a command deploys
(its τ and quantile table), and the provenance of every report."""
