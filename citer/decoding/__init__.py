"""Routed decoding: the engine loop over per-model KV pools, the cost meter, baseline routers, speculative decoding.

Bottom up: ``kv_pool`` (slots of rows) <- ``context`` (one call laid out) <- ``lean`` / ``compiled`` /
``static_step`` (the forward; on a CPU its products and a decode step's ops on :mod:`citer.kernels`) <- ``runner``
(one per model: how its calls run) <- ``session`` (the scheduler) <- ``engine``; ``speculative`` is transformers'
assisted generation metered alike.
"""
