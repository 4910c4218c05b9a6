"""A small draft model whose first sharded layer is gathered before its step (speculative decoding).

In the deployment of SGLang's weight sharding for Kimi K3 a draft model (dflash) runs after the target
model every step. Its weights are sharded too (its section "extending to attention and the draft"), and its layer 0 -- the first
sharded layer -- has no earlier layer whose compute could hide its gather. The answer ([Note: the draft's
first layer] in ``wsharding/core/first_layer.py``, a planner plug-in) is to issue that gather between the two models, on
a dedicated stream, and to wait on it just before the draft's step; this module gives the draft the step
that uses it.

The draft here is a :class:`~wsharding.models.ToyDecoder` with the target's dimensions and two layers
(:func:`draft_config`), every layer sharded -- layer 0, dense, included. A real draft reads the
target's hidden states; this one reads the same tokens, which changes nothing about its gathers.
"""

from __future__ import annotations

import torch

from wsharding.core.comm import Communicator
from wsharding.core.first_layer import FirstLayerPrefetch
from wsharding.core.runner import run_layers
from wsharding.core.sharding import WeightSharding
from wsharding.models.decoder import DecoderConfig, ToyDecoder, decoder_config


def draft_config(target: str | DecoderConfig, layers: int = 2) -> DecoderConfig:
    """The draft's configuration: the target's dimensions, ``layers`` layers (default 2)."""
    return decoder_config(target, layers)


class DraftDecoder(ToyDecoder):
    """A :class:`ToyDecoder` whose step finds its first sharded layer's gather handed over: the first
    sharded layer's weights were made ready before the step by ``draft.first_prefetch.wait()`` (after
    ``draft.first_prefetch.prefetch()``, or inline on a cold start). Without either call the step
    gathers that layer itself, as any model does.
    """

    @property
    def first_prefetch(self) -> FirstLayerPrefetch:
        """The planner plug-in that gathers the first sharded layer ahead of the step."""
        return FirstLayerPrefetch.of(self.planner)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        planner = self.planner
        if planner is None:
            h = run_layers(self.layers, h, None)
        else:
            # The plain loop: a first layer handed over by first_prefetch is joined, not gathered again.
            h = run_layers(self.layers, h, planner)
        return self.lm_head(self.norm(h))


def build_draft_pair(cfg: DecoderConfig, comm: Communicator, *, seed: int = 1, lookahead: bool = True,
                     trace: bool = False) -> tuple[DraftDecoder, DraftDecoder]:
    """The replicated draft and its sharded twin on this rank, every layer sharded (the first one is
    the layer the prefetch is for). ``seed`` differs from the target's default: different weights."""
    device = comm.device
    replicated = DraftDecoder(cfg, seed=seed, device=device).eval()
    ws = WeightSharding(comm, sharded_layers=range(cfg.layers), lookahead=lookahead, trace=trace)
    sharded = DraftDecoder(cfg, seed=seed, weight_sharding=ws, device=device).eval()
    ws.finalize()
    return replicated, sharded
