"""Counter-based randomness and token choice: a row draws the same noise whatever else is in its batch.

Every random decision of decoding (the random router's coin, temperature sampling) is a pure function of
(seed, stream, row id, step[, token id]), so batching, slot order and shared LLM calls never change a row's output.
"""

from __future__ import annotations

import numpy as np
import torch

_M32 = 0xFFFFFFFF
STREAM_ROUTER = 1
STREAM_SAMPLER = 2
_INT_ROWS = 16  # up to this many rows, counter_uniform hashes in Python ints


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 integer hash on int64 tensors holding 32-bit values; the multiply may wrap int64, the mask keeps
    # the (correct) low 32 bits.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


_M32_NP = np.uint64(_M32)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    # The same hash on uint64 arrays holding 32-bit values (numpy's unsigned multiply wraps; the mask keeps the low
    # 32 bits, which are those of the int64 tensor version).
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _M32_NP
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _M32_NP
    return x ^ (x >> np.uint64(16))


def _mix32_int(x: int) -> int:
    # The same hash on one Python int (exact, so it equals the tensor version bit for bit).
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def counter_uniform(
    seed: int, stream: int, row_ids: torch.Tensor, steps: torch.Tensor, width: int | None = None
) -> torch.Tensor:
    """Uniforms in (0, 1) that depend only on (seed, stream, row id, step[, column]), never on batch layout.

    row_ids, steps: (B,) int -> (B,) float64, or (B, width) float64 when ``width`` is given.
    """
    dev = row_ids.device
    h = _mix32_int((seed & _M32) ^ ((stream * 0x9E3779B9) & _M32))  # the (seed, stream) key: one Python int
    if (
        width is None
        and row_ids.device.type == "cpu"
        and row_ids.numel() <= _INT_ROWS
        and not torch.compiler.is_compiling()  # a traced step keeps to tensor ops: no read back
    ):
        # A few rows on the CPU (the router's coin at small batch): Python ints beat the tensor ops' overhead, same
        # bits.
        hs = [
            _mix32_int(_mix32_int(h ^ (r & _M32)) ^ (s & _M32))
            for r, s in zip(row_ids.tolist(), steps.tolist(), strict=True)
        ]
        return (torch.tensor(hs, dtype=torch.float64) + 0.5) / 4294967296.0
    if width is None and row_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        # More rows on the CPU: the same hash in numpy's uint64 (wrapping multiplies keep the same low 32 bits),
        # cheaper per op than tensor ops.
        hn = _mix32_np(np.uint64(h) ^ (row_ids.numpy().astype(np.uint64) & _M32_NP))
        hn = _mix32_np(hn ^ (steps.numpy().astype(np.uint64) & _M32_NP))
        return torch.from_numpy((hn.astype(np.float64) + 0.5) / 4294967296.0)
    h = _mix32(h ^ (row_ids.to(torch.int64) & _M32))
    h = _mix32(h ^ (steps.to(torch.int64) & _M32))
    if width is not None:
        cols = _mix32((torch.arange(width, device=dev, dtype=torch.int64) * 0x9E3779B9) & _M32)
        h = _mix32(h[:, None] ^ cols[None, :])  # (B, width)
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def select_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    seed: int,
    row_ids: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Greedy (temperature 0) or temperature/top-p sampling. logits (b, V) -> tokens (b,).

    Sampling is an exponential race on counter-based uniforms of (seed, row id, step, token id), so a row draws the
    same token whatever else is in its batch.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (b, V)
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()  # mass strictly above each token
        drop_sorted = before >= top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    dev = logits.device
    u = counter_uniform(seed, STREAM_SAMPLER, row_ids.to(dev), steps.to(dev), logits.shape[-1])  # (b, V)
    gumbel = -torch.log(-torch.log(u))  # (b, V) float64
    return (logp.double() + gumbel).argmax(dim=-1)
