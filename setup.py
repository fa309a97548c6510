"""Build of tierkv's optional native data path (csrc/), run by the normal install (`pip install -e .`).

Everything else lives in pyproject.toml. The extension is plain C loaded with ctypes (no Python
headers needed) and ``optional``: if no C compiler is found the install still succeeds and
connector/native.py falls back to numpy, saying so in the log and in its metric label.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "connector._native",
            sources=["csrc/tierkv_native.c"],
            extra_compile_args=["-O3", "-std=c11", "-fvisibility=default"],
            optional=True,
        )
    ]
)
