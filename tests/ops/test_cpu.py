"""The host CPU reader (citer.ops.cpu): the first processor's vendor, model and flags from /proc/cpuinfo texts of
x86 and ARM machines, and empty fields where there is no file."""

from __future__ import annotations

from citer.ops.cpu import host_cpu, parse

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Another
flags\t\t: fpu avx512_bf16 amx_tile
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd sve
CPU implementer\t: 0x41
"""


def test_the_first_processor_is_read_on_x86():
    cpu = parse(X86)
    assert (cpu.vendor, cpu.model, cpu.amd) == ("AuthenticAMD", "AMD EPYC 7B13", True)
    assert cpu.has("avx2", "fma") and not cpu.has(
        "avx2", "avx512_bf16"
    )  # the second processor's flags are not read
    assert cpu.listed(("avx512f", "fma", "avx2")) == ["fma", "avx2"]


def test_arm_features_are_its_flags_and_it_has_no_vendor():
    cpu = parse(ARM)
    assert cpu.vendor == "" and not cpu.amd and cpu.listed(("asimd", "sve", "avx2")) == ["asimd", "sve"]
    assert cpu.model  # the platform's name where cpuinfo has no model name


def test_no_cpuinfo_lists_nothing():
    cpu = parse("")
    assert cpu.vendor == "" and cpu.flags == frozenset() and not cpu.has("avx2")


def test_this_host_is_read_once():
    assert host_cpu() is host_cpu()
