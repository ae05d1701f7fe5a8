"""The model pair: loading (hub ids or directories), the embedded bootstrap, SLM finetuning, one model evaluated alone."""
