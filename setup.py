"""Build of tierkv's optional native data path (csrc/), run by the normal install (`pip install -e .`).

Everything else lives in pyproject.toml. The extension is plain C loaded with ctypes (no Python
headers needed) and ``optional``: if no C compiler is found the install still succeeds and
connector/native.py falls back to numpy, saying so in the log and in its metric label.
No ``-march`` flag: the SIMD kernels carry their own target attributes and the library picks
one at load time from the CPU it runs on, so a wheel built here runs on any x86-64 (or other) CPU.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "connector._native",
            sources=["csrc/tierkv_native.c", "csrc/xxh3_copy.c", "csrc/xxh3_kernels.c", "csrc/rope.c"],
            depends=["csrc/tkv.h", "csrc/xxh3.h"],
            # -ffp-contract=off: no fused multiply-add, so float results match torch's bit for bit
            extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-ffp-contract=off", "-fvisibility=default"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        # the engine's own: y = x @ w^T for a step of a few rows (engine/native_gemm.py); the engine
        # imports nothing of connector/, so it is a library of its own
        Extension(
            "engine._gemm",
            sources=["csrc/gemm.c"],
            # -fopenmp: libgomp.so.1, the OpenMP runtime torch has loaded (csrc/gemm.c says why)
            extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fvisibility=default"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
)
