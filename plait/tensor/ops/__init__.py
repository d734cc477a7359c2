"""plait.tensor.ops — one small rule module per op family, and the table they fill.

    registry     the table (op -> rule), OpCall, Sharding, the cost-based chooser,
                 torch's register_sharding
    pointwise    unary/binary/ternary, in-place, broadcasting, linear Partial patterns
    foreach      _foreach_* (optimizers), index by index as pointwise
    matmul       mm, addmm, bmm, baddbmm, dot, mv as einsum strategies
    view         view/reshape/squeeze/unsqueeze/expand/t/transpose/permute
    tensor_ops   slice/select/split/unbind/cat/stack/index_select, *_like, new_*
    reduction    sum/mean/amax/amin/max/min/var/std/argmax/vector_norm/_foreach_norm
    softmax      softmax/log_softmax forward and backward
    norm         layer_norm and RMS norm forward and backward
    embedding    embedding forward (vocabulary-sharded too) and backward
    loss         nll_loss forward and backward
    attention    scaled_dot_product_attention (CPU flash kernel) forward and backward
    random_ops   bernoulli/uniform/normal/..., native_dropout
    misc         item, equal, is_same_size
    dimwise      ops along some dims, independent along the rest: scans, sort/topk, flip/roll,
                 triu, linear algebra, pooling, resampling, gather/scatter, other reductions
    complex      view_as_real / view_as_complex (conj and neg bits: pointwise)
    indexing     index.Tensor (x[idx]): untouched dims or the index's own dims sharded
    conv         convolution forward and backward, batch-sharded

Importing this package registers every rule.
"""

from plait.tensor.ops import (  # noqa: F401 - imported to register their rules
    attention,
    complex,
    conv,
    dimwise,
    embedding,
    foreach,
    indexing,
    loss,
    matmul,
    misc,
    norm,
    pointwise,
    random_ops,
    reduction,
    softmax,
    tensor_ops,
    view,
)
from plait.tensor.ops.registry import RULES, OpCall, Sharding, register, register_sharding

__all__ = ["RULES", "OpCall", "Sharding", "register", "register_sharding"]
