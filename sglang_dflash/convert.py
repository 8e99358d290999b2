"""`sglang-dflash convert GGUF_FILE OUT_DIR`: a GGUF file -> a checkpoint directory SGLang serves.

    sglang-dflash convert model.gguf ~/models/my-target
    sglang-dflash convert model.gguf OUT --tokenizer HF_TOKENIZER_DIR   # the model's own tokenizer files
    sglang-dflash convert base.gguf OUT --chat-template template.jinja  # a base model's GGUF has no template

The weights are dequantized by transformers and stored in bf16 (the head tied to the embedding or not, as the GGUF
has it); eos / bos / pad ids, the chat template and the context length come from the GGUF's metadata
(sglang_dflash/targets/gguf_file.py says what transformers' own GGUF reading gets wrong and how it is fixed). It
prints what it wrote and the next two commands: serve the target by plain decoding, and train a drafter for it
(docs/TRAINING.md, "Your own target").
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time


def next_commands(out: str) -> list[tuple[str, str]]:
    """(what, command) after a conversion: serve by plain decoding, then the drafter path (docs/TRAINING.md)."""
    q = shlex.quote(out)
    prompts = shlex.quote(out.rstrip("/") + "-prompts.pt")
    run = shlex.quote(out.rstrip("/") + "-drafter")
    return [
        ("serve it by plain decoding (OpenAI API)", f"sglang-dflash serve --target {q} --no-speculation"),
        ("train a drafter for it (prompts once, then generate + train; docs/TRAINING.md, 'Your own target')",
         f"python -m sglang_dflash.train prepare --target {q} --out {prompts} && "
         f"python -m sglang_dflash.train run --target {q} --prompts {prompts} --out {run}"),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="sglang-dflash convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", metavar="GGUF_FILE", help="the .gguf file (one file; merge a split GGUF first)")
    p.add_argument("out", metavar="OUT_DIR", help="the checkpoint directory to write")
    p.add_argument("--tokenizer", metavar="DIR", help="use the model's own tokenizer files from DIR instead of "
                   "converting the GGUF's vocabulary (needed for Gemma-2/-4 GGUFs)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to write (default: the GGUF's)")
    p.add_argument("--force", action="store_true", help="overwrite a checkpoint already in OUT_DIR")
    args = p.parse_args(argv)

    from .targets.gguf_file import GGUFConvertError, convert_gguf

    t0 = time.time()
    print(f"[convert] reading {args.gguf} (transformers dequantizes the weights: ~20 s for 100 MB on 2 cores)",
          file=sys.stderr, flush=True)
    try:
        r = convert_gguf(args.gguf, args.out, tokenizer_dir=args.tokenizer, chat_template=args.chat_template,
                         force=args.force)
    except GGUFConvertError as e:
        sys.exit(f"sglang-dflash convert: error: {e}")
    stops = ", ".join(f"{t} ({i})" for t, i in zip(r.stop_tokens, r.stop_ids))
    print(f"wrote {r.out} in {time.time() - t0:.0f} s: {r.architecture}, {r.num_layers} layers, vocab {r.vocab_size}, "
          f"context {r.context_length}, bf16")
    print(f"  head: {'tied to the embedding' if r.tied else 'its own lm_head (the GGUF has output.weight)'}")
    print(f"  stop tokens: {stops}; bos: {r.bos}")
    print(f"  tokenizer: {r.tokenizer}; chat template: {r.chat_template}")
    for note in r.notes:
        print(f"  note: {note}")
    print("next:")
    for what, cmd in next_commands(str(args.out)):
        print(f"  # {what}\n  {cmd}")


if __name__ == "__main__":
    main()
