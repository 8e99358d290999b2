"""`sglang-dflash` / `python -m sglang_dflash`: three subcommands.

    sglang-dflash serve [--dry-run] [--target DIR] [--draft DIR] [--port N] [-- LAUNCH_SERVER_ARGS]
        an SGLang server with DFLASH speculative decoding (OpenAI API), see sglang_dflash.serve
    sglang-dflash demo [--max-new-tokens N] ...
        the reference engine on SmolLM2-135M-Instruct, DFlash against plain decoding, see sglang_dflash.demo
    sglang-dflash convert GGUF_FILE OUT_DIR [--tokenizer DIR] [--chat-template FILE] [--force]
        a GGUF file -> a checkpoint directory to serve (--target OUT_DIR) and train a drafter for, see
        sglang_dflash.convert
"""

import sys

COMMANDS = {"serve": "sglang_dflash.serve", "demo": "sglang_dflash.demo", "convert": "sglang_dflash.convert"}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        sys.exit(f"sglang-dflash: unknown command {argv[0]!r}. Fix: use one of {sorted(COMMANDS)} "
                 "(e.g. `sglang-dflash serve`)")
    import importlib

    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
