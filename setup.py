"""Compiles the parser's C fast path (aggregator/rs/_speedups.pyx); everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the pure-Python reader is
used (about 60 % of the speed). ``RSAGG_PURE_PYTHON=1`` at install time skips it on purpose.
"""

import os

from setuptools import Extension, setup


def extensions() -> list[Extension]:
    if os.environ.get("RSAGG_PURE_PYTHON"):
        return []
    import lxml  # build requirement: its C API headers and the bundled libxml2 headers
    from Cython.Build import cythonize

    ext = Extension(
        "aggregator.rs._speedups",
        ["aggregator/rs/_speedups.pyx"],
        include_dirs=lxml.get_include(),
        optional=True,
    )
    return cythonize([ext], language_level=3, quiet=True)


setup(ext_modules=extensions())
