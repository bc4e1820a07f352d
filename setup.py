"""The compiled hot-path kernels (chronomq.store._speedups, Cython; see
chronomq/store/speedups.py). Everything else
about the package is in pyproject.toml. The extension is optional: without a C compiler or Python's
headers the install still succeeds and the pure-Python kernels run."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "chronomq.store._speedups",
            ["src/chronomq/store/_speedups.pyx"],
            depends=["src/chronomq/store/_crc32.h"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
