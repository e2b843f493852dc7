"""Which x86 CPU this is: two CPU routes help on one vendor's CPUs and hurt on the other's.

torch's float32 `linear` goes through MKL. On an AMD CPU MKL runs a decode step's small products at about 40% of
what the machine does, and oneDNN's inner product (or (W·Xᵀ)ᵀ for 2-4 rows) runs them at its speed; on an Intel
CPU MKL runs them at full speed and the other routes are slower. The demo's float32 decode step, one sequence, 2
threads (benchmarks/studies/serving/cpu_dense_decode.py): an AMD EPYC 39.5 ms through `linear` against 26.9 ms
routed (kernels/cpu_dense.py); an Intel Xeon 30.2 ms against 43.9 routed (batch 4: 45.1 against 62.3). The
same for one bfloat16 query token's attention (benchmarks/studies/serving/decode_attention.py, 300 cached
positions): torch's flash-attention CPU kernel 125 µs against 40 µs for a float32 matmul-softmax
(kernels/decode_attention.py) on the EPYC, 28 against 63 on the Xeon. So both routes are taken on AMD CPUs only;
on any other CPU, or where the vendor cannot be read, torch's own routes run.
"""

from __future__ import annotations

from pathlib import Path


def cpu_field(key: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's `key` as /proc/cpuinfo gives it ("vendor_id", "model name"); "" where it says none."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.split(":", 1)[0].strip() == key:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's vendor id ("AuthenticAMD", "GenuineIntel"); "" where /proc/cpuinfo says none."""
    return cpu_field("vendor_id", cpuinfo)


AMD = cpu_vendor() == "AuthenticAMD"  # the CPUs on which cpu_dense.py's and decode_attention.py's routes are faster
