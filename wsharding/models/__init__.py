"""Models written with wsharding's linears: a small decoder shaped like the deployment of
SGLang's weight sharding for Kimi K3."""

from wsharding.models.decoder import (
    PRESETS,
    VARIANTS,
    DecoderConfig,
    ToyDecoder,
    build_pair,
    decoder_config,
    variant_config,
)

__all__ = ["PRESETS", "VARIANTS", "DecoderConfig", "ToyDecoder", "build_pair", "decoder_config", "variant_config"]
