"""plait.models.llama — a Llama-style decoder, its named configs and its parallelization plan.

    from plait.models.llama import CONFIGS, Transformer
    torch.manual_seed(0)
    model = Transformer(CONFIGS["tiny"]); model.init_weights()
    logits = model(tokens)                        # (b, s) -> (b, s, vocab)
    parallelize_llama(model, mesh["tp"])          # or parallelize_module(model, mesh["tp"], tp_plan())

FQNs follow torchtitan (`tok_embeddings`, `layers.{i}.attention.wq`, `layers.{i}.ffn_norm`,
`norm`, `output`), so plans and checkpoints written for torchtitan's Llama apply.
"""

from plait.models.llama.args import CONFIGS, ModelArgs
from plait.models.llama.model import Attention, FeedForward, Transformer, TransformerBlock
from plait.models.llama.parallelize import check_tp_degree, parallelize_llama, tp_plan

__all__ = ["CONFIGS", "Attention", "FeedForward", "ModelArgs", "Transformer", "TransformerBlock",
           "check_tp_degree", "parallelize_llama", "tp_plan"]
