"""`plait generate CHECKPOINT --prompt "def "`: sample text from a `plait train` checkpoint, in one
process, to see what the model learned.

    CHECKPOINT (a plait.checkpoint directory, any layout) -> its saved config ("app.config")
    -> Transformer(model_args(config)) <- full tensors "app.model.*" read from every rank's chunks
    -> tokenizer (byte, or the run's cached BPE) -> prompt tokens (1, t)
    -> repeat: logits of the last position (window of max_seq_len) / temperature, top-k,
       sample -> append  (no KV cache: the reference model recomputes the window; fine at this size)
"""

from __future__ import annotations

import argparse
import sys

import torch

from plait.checkpoint import FileSystemReader
from plait.checkpoint.tools import full_tensor
from plait.checkpoint.values import decode

PREFIX_MODEL, CONFIG_KEY = "app.model.", "app.config"  # the config is one JSON value


def load_checkpoint(path: str):
    """(model in eval mode, tokenizer, JobConfig) from a `plait train` checkpoint."""
    from plait.data.text import build_corpus
    from plait.models.llama import Transformer
    from plait.train.config import from_dict
    from plait.train.trainer import model_args

    reader = FileSystemReader(path)
    md = reader.read_metadata()
    nested = decode(md.values[CONFIG_KEY]) if CONFIG_KEY in md.values else None
    if not nested:
        raise ValueError(f"{path} holds no trainer config (app.config): is it a `plait train` checkpoint?")
    config = from_dict(nested)
    model = Transformer(model_args(config))
    state = {fqn[len(PREFIX_MODEL):]: full_tensor(reader, md, fqn) for fqn in md.tensors
             if fqn.startswith(PREFIX_MODEL)}
    model.load_state_dict(state, strict=False)  # rope_cache is a buffer, not saved
    missing = set(dict(model.named_parameters())) - set(state)
    if missing:
        raise ValueError(f"{path} lacks parameters {sorted(missing)[:5]}")
    d = config.data
    if d.tokenizer == "byte":
        from plait.data.text import ByteTokenizer

        tok = ByteTokenizer()
    else:
        from pathlib import Path

        _, tok = build_corpus(path=d.path, glob=d.glob, max_bytes=d.max_bytes, tokenizer=d.tokenizer,
                              vocab_size=d.vocab_size, cache_dir=Path(config.job.dir) / "tokenizer")
    return model.eval(), tok, config


@torch.no_grad()
def generate(model, tokens: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 50, generator: torch.Generator | None = None) -> torch.Tensor:
    """tokens (1, t) -> (1, t + max_new_tokens)."""
    window = model.args.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -window:])[:, -1, :]  # (1, vocab)
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait generate", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory written by `plait train`")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model, tok, _ = load_checkpoint(args.checkpoint)
    except (ValueError, FileNotFoundError) as e:
        print(f"plait generate: {e}", file=sys.stderr)
        return 2
    prompt = tok.encode(args.prompt.encode())[None, :]
    out = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, generator=torch.Generator().manual_seed(args.seed))
    print(tok.decode(out[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
