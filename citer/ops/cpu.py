"""The host's CPU as ``/proc/cpuinfo`` describes it, read once a process: its vendor, model name and flags.

Kernel choices (:mod:`citer.kernels.cpu_linear`), provenance's machine kind and the speed benches' reports all ask
the same file; one cached reader answers them. Where the file is absent (macOS, a locked-down container) every field
is empty, so a caller takes its portable path.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class HostCpu:
    """The first processor's entry: ``vendor`` (``vendor_id``, e.g. ``AuthenticAMD``, ``GenuineIntel``; empty on ARM),
    ``model`` (``model name``, else the platform's processor or machine) and ``flags`` (``flags``, or ``Features`` on
    ARM)."""

    vendor: str
    model: str
    flags: frozenset[str]

    def has(self, *flags: str) -> bool:
        """Whether every one of ``flags`` is listed."""
        return all(f in self.flags for f in flags)

    def listed(self, names: tuple[str, ...]) -> list[str]:
        """Those of ``names`` this CPU lists, in ``names``' order."""
        return [f for f in names if f in self.flags]

    @property
    def amd(self) -> bool:
        return self.vendor == "AuthenticAMD"


def parse(text: str) -> HostCpu:
    """A ``/proc/cpuinfo`` text -> its first processor's :class:`HostCpu`."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's entry
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags") or fields.get("Features") or ""
    model = fields.get("model name") or platform.processor() or platform.machine()
    return HostCpu(vendor=fields.get("vendor_id", ""), model=model, flags=frozenset(flags.split()))


@functools.cache
def host_cpu() -> HostCpu:
    """This machine's CPU (cached: the file is read at the first call only)."""
    try:
        text = CPUINFO.read_text(encoding="utf-8")
    except OSError:
        text = ""
    return parse(text)
