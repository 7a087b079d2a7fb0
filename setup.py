"""Builds kvstore's one C extension, kvstore._copyhash: a copy and its xxh3-64 in one pass
over the bytes (kvstore/native/copyhash.c, over the vendored xxhash.h). Everything else about
the package is in pyproject.toml."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

GCC_LIKE_FLAGS = ["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Werror=implicit"]
MSVC_FLAGS = ["/O2"]


class BuildExt(build_ext):
    """The compiler's own optimisation flags: GCC and clang's, or MSVC's."""

    def build_extensions(self):
        flags = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else GCC_LIKE_FLAGS
        for extension in self.extensions:
            extension.extra_compile_args = flags
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "kvstore._copyhash",
            sources=["kvstore/native/copyhash.c"],
            depends=["kvstore/native/xxhash.h"],
            include_dirs=["kvstore/native"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
