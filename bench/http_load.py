"""The load generator of ``bench/serving.py``: concurrent streaming clients of an OpenAI-style ``/v1/completions``.

:func:`load` runs the clients in a child process (this file, which imports nothing heavy), so the server's
interpreter lock stays the server's and a level starts in a fraction of a second. Each client sends its requests one
after another and streams every answer, recording the time to the first text and to the end. The clients use
aiohttp, whose C parser keeps up with 32 streams where httpx's pure-Python one could not.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

MODEL = "citer-bench"


async def _client(base: str, bodies: list[dict], out: list[dict]) -> None:
    import aiohttp

    async with aiohttp.ClientSession(base_url=base, timeout=aiohttp.ClientTimeout(total=600)) as c:
        for body in bodies:
            t0 = time.perf_counter()
            first, text, usage, status = None, "", None, 0
            async with c.post("/v1/completions", json=body) as r:
                status = r.status
                async for raw in r.content:
                    line = raw.decode().rstrip("\n")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices", []):
                        if ch.get("text"):
                            first = first or time.perf_counter() - t0
                            text += ch["text"]
            out.append(dict(prompt=body["prompt"], status=status, text=text, ttft=first,
                            latency=time.perf_counter() - t0, tokens=(usage or {}).get("completion_tokens", 0)))  # fmt: skip


def load(
    base: str, prompts: list[str], clients: int, per_client: int, max_tokens: int
) -> tuple[list[dict], float]:
    """Run the clients in a separate process (the server's GIL stays the server's); returns results and wall time."""
    spec = dict(base=base, prompts=prompts, clients=clients, per_client=per_client, max_tokens=max_tokens)
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True,
                          check=False, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["results"], out["wall_s"]


def _load_here(spec: dict) -> None:
    clients, max_tokens, prompts = spec["clients"], spec["max_tokens"], spec["prompts"]
    bodies = [dict(model=MODEL, prompt=prompts[i % len(prompts)], max_tokens=max_tokens, stream=True,
                   stream_options={"include_usage": True}) for i in range(clients * spec["per_client"])]  # fmt: skip
    out: list[dict] = []

    async def run() -> None:
        await asyncio.gather(*(_client(spec["base"], bodies[k::clients], out) for k in range(clients)))

    t0 = time.perf_counter()
    asyncio.run(run())
    print(json.dumps({"results": out, "wall_s": time.perf_counter() - t0}))


if __name__ == "__main__":
    _load_here(json.loads(sys.argv[1]))
