"""wsharding: weight sharding for LLM inference.

Every rank of a group stores 1/N of the weights that would otherwise be replicated on each GPU; one
AllGather per layer rebuilds the layer's weights, into one of two slots, just before it computes.
Storage is sharded; compute is not.
"""

from wsharding.layout import FlatLayout, LayoutEntry, LayoutError, OwnedPiece

__version__ = "0.1.0"
__all__ = ["FlatLayout", "LayoutEntry", "LayoutError", "OwnedPiece", "__version__"]
