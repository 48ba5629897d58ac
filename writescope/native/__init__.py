"""What the native CPU kernels share (attention/cpu_kernel*, moe/cpu_experts*): the CPU-flag checks
and the choice of path (cpu_features.h), AVX-512 helpers (avx512_math.h), the AMX tile configuration and tiles emulated in
C++ for machines without AMX (amx.h), per-thread scratch buffers (scratch.h), a plain read of given bytes as the reference
rate (read_probe.h), the persistent worker driven by flags in pinned memory (flag_worker.h, flag_worker.py: the
CPU attention worker and the host-expert worker), and the build (build.py)."""
