"""The compiled hot-path kernels: the broker's (chronomq.store._speedups, Cython; see
chronomq/store/speedups.py) and the client's decode of a pull answer (chronomq.remoting._decode, Cython;
see chronomq/remoting/decode.py). Everything else about the package is in pyproject.toml. Both extensions
are optional: without a C compiler or Python's headers the install still succeeds and the pure-Python
twins run."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "chronomq.store._speedups",
            ["src/chronomq/store/_speedups.pyx"],
            depends=["src/chronomq/store/_crc32.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "chronomq.remoting._decode",
            ["src/chronomq/remoting/_decode.pyx"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
