"""Routed decoding: the engine loop over a per-row ragged KV cache, the cost meter, baseline routers, speculative decoding.

Bottom up: ``forward`` (logits + the router's hidden state), ``sampling`` (batch-invariant noise), ``cost`` <-
``kv_cache`` <- ``baselines`` <- ``engine``; ``speculative`` is transformers' assisted generation metered alike.
"""
