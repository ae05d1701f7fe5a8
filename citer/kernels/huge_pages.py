"""A CPU model's weights on 2 MiB pages: :class:`Arena`.

A decode step on a CPU streams every weight once. On 4 KiB pages a 135M model's 270 MB of bf16 weights span ~66k
pages, far more than the TLB holds, so the stream pays a page walk every 4 KiB; on 2 MiB pages they span ~130. Linux
backs an anonymous mapping advised ``MADV_HUGEPAGE`` with 2 MiB pages where transparent huge pages are ``madvise``
(the usual default) or ``always``; torch's own allocator asks for them only under ``THP_MEM_ALLOC_ENABLE=1``, which
it reads once, at its first allocation (while torch is imported), so a library cannot turn it on. An :class:`Arena`
is such a mapping; the lean decoder moves a CPU model's weights into one, layer by layer, and points the HF parameters
and its own tensors at the copies (:class:`citer.decoding.lean.LeanDecoder`), so the values and every output stay the
same. What it gains, by model and rows, is measured in docs/results.md.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

PAGE = 2 << 20  # bytes of a huge page on x86-64
ALIGN = 64  # bytes each storage starts at a multiple of (a cache line, as torch's allocator)
# Weights below this many bytes keep torch's allocations: their stream spans too few pages for the walks to matter,
# and the copy (a pass over the weights at load) would be paid for nothing. The pipeline's tiny models lie far below.
MIN_BYTES = 64 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """True where an advised anonymous mapping gets huge pages: Linux with transparent huge pages not ``never``."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def cpu_storages(tensors: Iterable[torch.Tensor]) -> dict[int, int] | None:
    """Each distinct storage under ``tensors`` (however many views share it), address -> bytes, in the order first
    seen; None where one is off the CPU. Sizes only: holding the storages would keep each old one alive while an
    :class:`Arena` copies the next."""
    sizes: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "cpu":
            return None
        s = t.untyped_storage()
        sizes.setdefault(s.data_ptr(), s.nbytes())
    return sizes


def wanted(sizes: dict[int, int] | None) -> bool:
    """True where an :class:`Arena` should take the storages :func:`cpu_storages` found: all on the CPU, at least
    :data:`MIN_BYTES` of them, and huge pages :func:`available`."""
    return bool(sizes) and sum(sizes.values()) >= MIN_BYTES and available()


class Arena:
    """One anonymous mapping advised for huge pages, 2 MiB aligned, with room for the CPU storages it is sized for
    (each 64-byte aligned). Calling it moves a tensor: its
    storage is copied in on first use, and the same view (shape, strides, offset) over the copy is returned; a tensor
    already in the arena is returned as it is. Copying storage by storage lets the caller drop each old storage as it
    goes, so moving a model needs little more memory than the model. The mapping lives as long as any view of it."""

    def __init__(self, sizes: dict[int, int]) -> None:
        """``sizes``: :func:`cpu_storages` of the tensors it will move."""
        self._offsets: dict[int, int] = {}  # an old storage's address -> its copy's byte offset
        total = 0
        for address, nbytes in sizes.items():
            self._offsets[address] = total
            total += -(-nbytes // ALIGN) * ALIGN
        size = max(-(-total // PAGE) * PAGE, PAGE)
        mapping = mmap.mmap(-1, size + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # advised before the first write, so the pages are huge when first touched
        mapping.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
        start = (-raw.data_ptr()) % PAGE
        self._bytes = raw[start : start + size]
        self._copied: set[int] = set()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() == self._bytes.untyped_storage().data_ptr():
            return t
        o = self._offsets[s.data_ptr()]
        dst = self._bytes[o : o + s.nbytes()]
        if s.data_ptr() not in self._copied:
            dst.copy_(torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)))
            self._copied.add(s.data_ptr())
        base = dst.view(t.dtype)
        return base.as_strided(t.shape, t.stride(), base.storage_offset() + t.storage_offset())
