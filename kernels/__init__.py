"""GPU kernels of sglang-dflash, installed as ``sglang_dflash.kernels``.

This folder is the user-facing ``kernels/`` of the repository; it ships under ``sglang_dflash`` because SGLang
depends on the unrelated PyPI package ``kernels`` and a top-level package of that name would shadow it.
Every kernel sits beside a plain-torch reference of the same function (see sglang_dflash.acceptance) and a test
compares the two.
"""
