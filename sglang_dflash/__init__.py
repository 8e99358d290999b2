"""sglang-dflash: DFlash block-diffusion speculative decoding for SGLang.

The algorithm (importable without SGLang):
    config.DFlashConfig        the drafter's config.json, validated against the target
    drafter.DFlashDrafter      the drafter module (published weight names)
    checkpoint                 load_drafter / save_drafter in the published layout
    sampling / acceptance      the target's processed distribution; greedy and exact sampled verification
    reference.ReferenceEngine  lossless pure-torch engine: the oracle and the CPU demo
The SGLang glue lives in sglang_dflash.serving (imported only by SGLang's plugin loader); model recipes and
fixtures in sglang_dflash.targets; the server launcher and CPU harness for tests and benchmarks in
sglang_dflash.testing.
"""

__version__ = "0.1.0"
