"""This rank's share of a live, sharded Megatron policy in Hugging Face names and coordinates.

:func:`rank_layout` reads the rank's coordinates for the mapping (:class:`~megatron_gspo.hf.mapping.RankLayout`)
from the process groups and the model; :func:`local_hf_pieces` lists the rank's parameters (or
other tensors of the same names, e.g. gradients) as HF pieces through the one mapping
(``hf.mapping.iter_hf_pieces``). The weight sync's gather (:mod:`megatron_gspo.hf.gather`), the
model's HF initialisation (``model.gpt.load_hf_weights``) and the tests' layout comparisons use
them; nothing here builds or runs the model.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_gspo.config import ModelConfig, padded_vocab_size
from megatron_gspo.hf.mapping import RankLayout, iter_hf_pieces


def unwrap(module):
    """The bare model inside DDP / Float16Module wrappers (each holds the next as ``.module``)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def rank_layout(gpt, model: ModelConfig, pg_collection) -> RankLayout:
    """This rank's coordinates for the HF mapping, read from the process groups and the model."""
    tp = pg_collection.tp
    return RankLayout(
        tp_rank=tp.rank(), tp_size=tp.size(),
        ep_rank=pg_collection.ep.rank(), ep_size=pg_collection.ep.size(),
        etp_rank=pg_collection.expt_tp.rank(), etp_size=pg_collection.expt_tp.size(),
        layer_offset=get_transformer_layer_offset(gpt.config, pp_rank=pg_collection.pp.rank()),
        padded_vocab_size=padded_vocab_size(model, tp.size()),
    )


def local_hf_pieces(gpt, model: ModelConfig, pg_collection, *, tensors=None):
    """Yield (Piece, local sub-tensor) for every local parameter (or for ``tensors``: name->tensor,
    e.g. gradients) in HF names and coordinates."""
    gpt = unwrap(gpt)
    layout = rank_layout(gpt, model, pg_collection)
    named = tensors.items() if tensors is not None else (
        (n, p.detach()) for n, p in gpt.named_parameters())
    yield from iter_hf_pieces(named, model, layout)
