"""Builds kvstore's one C extension, kvstore._copyhash: a copy and its xxh3-64 in one pass
over the bytes (kvstore/native/copyhash.c, over the vendored xxhash.h). Everything else about
the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._copyhash",
            sources=["kvstore/native/copyhash.c"],
            depends=["kvstore/native/xxhash.h"],
            include_dirs=["kvstore/native"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Werror=implicit"],
        )
    ]
)
