"""`python -m sglang_dflash` (and the `sglang-dflash` script): the CPU demo, see sglang_dflash.demo."""

from .demo import main

if __name__ == "__main__":
    main()
