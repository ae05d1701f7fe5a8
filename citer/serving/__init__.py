"""Serving the champion: loading it as a ready engine, routed batch inference, the OpenAI-compatible HTTP server."""
