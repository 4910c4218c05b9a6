"""Models written with wsharding's linears: a small decoder shaped like the first seed's deployment."""

from wsharding.models.decoder import PRESETS, DecoderConfig, ToyDecoder, build_pair, decoder_config

__all__ = ["PRESETS", "DecoderConfig", "ToyDecoder", "build_pair", "decoder_config"]
