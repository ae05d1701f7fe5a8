"""CPU kernels for decode calls, built from their C++ sources at first use: few-row linears that read each weight once
(``cpu_linear``: bf16 by AVX512-BF16 and AMX, float32 by AVX2, oneDNN's packed weights for more rows), a decode
step's row-wise ops in the same extensions (called by :mod:`citer.decoding.cpu_step`), and a large model's weights on
2 MiB pages (``huge_pages``). Nothing here knows about routing or KV pools."""
