"""The router's training side: token-level preference labels, their store, the MLP router, its MLflow pyfunc wrapper."""
